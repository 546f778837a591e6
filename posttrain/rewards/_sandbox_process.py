"""One sandboxed program as a host process: its launcher (limits, then the program as
`__main__`), stdin in, stdout and stderr read concurrently and capped, the wall-clock deadline
and the kill of its whole process group, and what it did (`SandboxResult`)."""

from __future__ import annotations

import ast
import contextlib
import os
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass

from posttrain.rewards._sandbox_bwrap import SandboxError

_GRACE_S = 10.0  # past a workspace run's timeout: the supervisor's own time to clean up and save
# Runs inside as `python -I -S -B -c _LAUNCHER`: reports "started" on its own pipe (so a
# container that failed to start is an error, not a crash of the program; in a workspace run the
# supervisor reports it and sets the limits instead), sets the limits, runs
# main.py as __main__. -S skips site (faster start, no site-packages), so exit()/quit() are
# restored by hand; the hook hides the launcher's own frame from tracebacks.
_LAUNCHER = """\
import builtins, os, resource, sys
_started = {started_fd!r}
if _started is not None:
    os.write(_started, b"1")
    os.close(_started)
[resource.setrlimit(k, (soft, hard)) for k, soft, hard in {limits!r}]
def _hook(t, v, tb, _h=sys.__excepthook__):
    if tb is not None and tb.tb_frame.f_code.co_filename == "<string>":
        tb = tb.tb_next
        v = v.with_traceback(tb)
    _h(t, v, tb)
sys.excepthook = _hook
builtins.exit = builtins.quit = sys.exit
sys.argv = [{main!r}]
sys.path[:0] = {path_head!r}
__file__ = {main!r}
with open(__file__, "rb") as _f:
    _code = compile(_f.read(), __file__, "exec")
del builtins, os, resource, sys, _started, _hook, _f
exec(_code)
"""
# bash: the same start report and limits, then the script replaces the launcher, with the
# SIGPIPE and SIGXFSZ that Python ignores back to their defaults (`yes | head` ends, a write
# past the file size limit kills the writer).
_BASH_LAUNCHER = """\
import os, resource, signal
os.write({started_fd}, b"1")
os.close({started_fd})
for _k, _soft, _hard in {limits!r}:
    resource.setrlimit(_k, (_soft, _hard))
for _s in (signal.SIGPIPE, signal.SIGXFSZ):
    signal.signal(_s, signal.SIG_DFL)
os.execv("/bin/bash", ["bash", {main!r}])
"""


def _launcher(language: str, started_fd: int | None, limits, main: str, path_head) -> str:
    """The launcher's source: `main` is the program, `path_head` goes first on `sys.path`;
    it reports its start on `started_fd` (None: the workspace supervisor does)."""
    template = _LAUNCHER if language == "python" else _BASH_LAUNCHER
    return template.format(
        started_fd=started_fd, limits=limits, main=main, path_head=list(path_head)
    )


@dataclass(frozen=True)
class SandboxResult:
    """What one sandboxed execution did."""

    # The program's exit status; None if a signal killed it or it timed out. Without a
    # workspace, bwrap reports death by signal N as status 128 + N, so a program exiting with
    # 129..192 reads as killed; with one, the supervisor reports the exact status.
    exit_code: int | None
    stdout: str  # decoded as UTF-8 (invalid bytes replaced), at most max_output_bytes
    stderr: str
    timed_out: bool  # killed at the wall-clock timeout
    killed_by_signal: int | None = None  # SIGKILL (9) at a timeout, SIGXCPU (24) at the CPU limit
    stdout_truncated: bool = False  # output past max_output_bytes was read and discarded
    stderr_truncated: bool = False
    oom: bool = False  # died with a MemoryError at the address-space limit
    wall_s: float = 0.0  # from container start to exit, startup included
    backend: str = "bwrap"  # "bwrap" or "subprocess" (the unsafe opt-in)
    # Why a read-write workspace run's changes were not kept (the workspace is as it was
    # before the run); None when they were, or without a writable workspace.
    workspace_error: str | None = None

    @property
    def ok(self) -> bool:
        """Exited with status 0 within the timeout."""
        return self.exit_code == 0 and not self.timed_out


class _Sink:
    """What one output fd gave: kept up to `cap` bytes (in memory, or written to `file`), the
    rest read and discarded (flagged truncated)."""

    def __init__(self, cap: int, file=None):
        self.data, self.cap, self.file = bytearray(), cap, file
        self.size, self.truncated = 0, False

    def add(self, chunk: bytes) -> None:
        keep = chunk[: max(self.cap - self.size, 0)]
        if self.file is not None:
            self.file.write(keep)
        else:
            self.data += keep
        self.size += len(keep)
        self.truncated = self.truncated or len(keep) < len(chunk)


def _execute(
    argv_for, backend: str, io, workspace=None, save=None, pass_fds=(), **popen_kwargs
) -> SandboxResult:
    """Runs argv_for(started fd) in its own session: stdin in, capped output out, deadline.

    With a workspace, the container's supervisor enforces the timeout itself and then packs
    the workspace; the deadline here is only its backstop, `_GRACE_S` (plus 1 s per 64 MB of
    workspace) later."""
    stdin, timeout_s, cap = io
    popen_kwargs.setdefault("env", {})  # the host's environment never reaches the sandbox
    started_r, started_w = os.pipe()
    try:
        start = time.monotonic()
        proc = subprocess.Popen(
            argv_for(started_w),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            pass_fds=(*pass_fds, started_w),
            **popen_kwargs,
        )
    except BaseException:
        os.close(started_r)
        raise
    finally:
        os.close(started_w)
    out, err, ctl = _Sink(cap), _Sink(cap), _Sink(1 << 16)
    sinks = {proc.stdout.fileno(): out, proc.stderr.fileno(): err, started_r: ctl}
    if save is not None:
        save.close_write_end()
        archive = sinks[save.pipe_r] = _Sink(save.cap, save.file)
    deadline = start + timeout_s
    if workspace is not None:
        deadline += _GRACE_S + workspace.size_mb / 64
    try:
        timed_out = _communicate(proc, sinks, stdin, deadline)
    finally:
        _kill_group(proc)  # no-op after a clean exit; on errors nothing may stay behind
        os.close(started_r)
    wall = time.monotonic() - start
    code, stderr = proc.returncode, err.data.decode(errors="replace")
    started, report = ctl.data[:1] == b"1", {}
    if workspace is not None and not timed_out:
        try:
            report = ast.literal_eval(ctl.data[started:].decode() or "{}")
        except (ValueError, SyntaxError, UnicodeDecodeError):
            report = None
        if not isinstance(report, dict):
            report = {"error": f"unreadable report {bytes(ctl.data[:200])!r}"}
        if "error" in report:
            raise SandboxError(f"the workspace supervisor failed: {report['error']}; {stderr}")
    if not started and not timed_out:
        raise SandboxError(
            f"the {backend} sandbox exited ({code}) before running the program: "
            f"{stderr.strip()[-1000:]}"
        )
    signum = -code if code < 0 else None
    if backend == "bwrap" and 128 < code < 128 + signal.NSIG:
        signum = code - 128  # bwrap reports a child killed by signal N as exit status 128 + N
    ws_error = None
    if workspace is not None:  # the supervisor's report, not bwrap's status, says what ran
        code = report.get("code")
        timed_out = timed_out or code is None
        signum = int(signal.SIGKILL) if timed_out else (-code if code < 0 else None)
        if save is not None:
            ws_error = save.keep(archive, report, timed_out)
    return SandboxResult(
        exit_code=None if signum or timed_out else code,
        stdout=out.data.decode(errors="replace"),
        stderr=stderr,
        timed_out=timed_out,
        killed_by_signal=signum,
        stdout_truncated=out.truncated,
        stderr_truncated=err.truncated,
        oom=not timed_out and stderr.rstrip().rpartition("\n")[2].startswith("MemoryError"),
        wall_s=wall,
        backend=backend,
        workspace_error=ws_error,
    )


def _communicate(proc: subprocess.Popen, sinks: dict, stdin: bytes, deadline: float) -> bool:
    """Feeds stdin and reads every fd of `sinks` to its end, until the deadline; timed out?"""
    timed_out = False
    with selectors.DefaultSelector() as sel:
        for fd in sinks:
            sel.register(fd, selectors.EVENT_READ)
        pending = memoryview(stdin)
        if pending:
            os.set_blocking(proc.stdin.fileno(), False)
            sel.register(proc.stdin, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        while len(sel.get_map()) > 0:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if timed_out:  # still open 1 s after the kill: give up on the rest
                    break
                timed_out = True
                _kill_group(proc)
                deadline = time.monotonic() + 1.0
                continue
            for key, _ in sel.select(remaining):
                if key.fileobj is proc.stdin:
                    try:
                        pending = pending[os.write(key.fd, pending[: 1 << 16]) :]
                    except (BrokenPipeError, BlockingIOError) as e:
                        pending = pending[:0] if isinstance(e, BrokenPipeError) else pending
                    if not pending:
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                    continue
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                sinks[key.fd].add(chunk)
    if not proc.stdin.closed:
        proc.stdin.close()
    if not timed_out:
        try:  # the output is closed; main.py may still be running (it closed its stdout)
            proc.wait(max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            timed_out = True
    if timed_out:
        _kill_group(proc)
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    return timed_out


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
