"""Runs untrusted Python or bash in a fresh bubblewrap container per execution, under hard limits.

Each `run` starts one container (see `_sandbox_bwrap` for what it can see) holding one tiny
launcher that sets the rlimits and then executes `/tmp/main.py` as `__main__` (or `exec`s
`/bin/bash /tmp/main.sh`):

- CPU time (`RLIMIT_CPU`, a backstop to the wall-clock timeout), address space
  (`RLIMIT_AS` = `memory_mb`, per process), processes and threads (`RLIMIT_NPROC`, counted per
  container thanks to its own user namespace), open files (`RLIMIT_NOFILE`), file size
  (`RLIMIT_FSIZE`) and no core dumps; /tmp and /dev/shm are tmpfs mounts capped at `tmp_mb`.
- A wall-clock timeout SIGKILLs bwrap's process group; the container's PID 1 dies with it
  (`--die-with-parent`), and the kernel then kills everything left in its PID namespace, so
  daemonised children never outlive a run, which also ends as soon as `main.py` exits (bwrap
  reports the exit a moment, milliseconds, before the kernel has killed the rest).
- stdout and stderr are read concurrently, each kept up to `max_output_bytes` and then
  drained and discarded (flagged truncated), so a program printing 100 MB costs no memory.

A `Workspace` (`make_workspace`) persists `/workspace` across runs (an episode's files) with
nothing of the host bound in: it lives on the host as a tar archive, and in a run the
container's PID 1 is a trusted supervisor (`_sandbox_bwrap.SUPERVISOR`) that mounts a fresh
tmpfs capped at the workspace's size and inode count (a write past either fails with ENOSPC
inside), unpacks the archive into it, runs the program, enforces the timeout itself, kills
every process the program started once it exits, and only then packs the tmpfs into a new
archive (at most the workspace's size of file data), which replaces the old one when it came
whole. `workspace_readonly` mounts it read-only and keeps nothing. The program cannot touch the
supervisor: it is the namespace's init (no signal from inside reaches it) and undumpable (no
ptrace, no /proc/1/fd).

Where bwrap is missing or unusable, `run` raises `SandboxUnavailableError` saying how to install
it, unless the caller opts into `backend="subprocess"` (or `POSTTRAIN_SANDBOX=unsafe-subprocess`):
the same rlimits (minus `RLIMIT_NPROC`, which counts all of the user's processes there) and
timeout in a temporary directory, with no filesystem, network or process isolation; it warns.

Known gaps: memory is capped per process, so a program can hold up to `max_procs * memory_mb`
in total (no cgroup); there is no seccomp filter, so the kernel's whole syscall surface is
reachable, within the namespaces.
"""

from __future__ import annotations

import ast
import contextlib
import os
import resource
import selectors
import signal
import subprocess
import tempfile
import time
import warnings
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import posttrain.rewards._sandbox_bwrap as _bw
from posttrain.rewards._sandbox_bwrap import (
    SandboxError,
    SandboxUnavailableError,
    Workspace,
    make_workspace,
    remove_workspace,
)

__all__ = [
    "SandboxError",
    "SandboxPool",
    "SandboxResult",
    "SandboxUnavailableError",
    "UnsafeSandboxWarning",
    "Workspace",
    "make_workspace",
    "remove_workspace",
    "run",
]

_UNSAFE = ("subprocess", "unsafe-subprocess")
_GRACE_S = 10.0  # past a workspace run's timeout: the supervisor's own time to clean up and save
_MAINS = {"python": "main.py", "bash": "main.sh"}
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


class UnsafeSandboxWarning(UserWarning):
    """Untrusted code runs under the subprocess backend: rlimits and a timeout only."""


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


def run(
    code: str,
    *,
    stdin: str = "",
    timeout_s: float,
    memory_mb: int,
    language: str = "python",
    files: dict[str, str] | None = None,
    workspace: Workspace | None = None,
    workspace_readonly: bool = False,
    max_procs: int = 32,
    max_output_bytes: int = 1 << 20,
    file_size_mb: int = 16,
    tmp_mb: int = 64,
    backend: str | None = None,
) -> SandboxResult:
    """Runs a Python program or a bash script in a fresh sandbox and returns what it did.

    Args:
      code: the program, run as `/tmp/main.py` (or `/tmp/main.sh`); its working directory is
        `/tmp`, or `/workspace` when there is a workspace.
      stdin: fed to the program's standard input.
      timeout_s: wall-clock limit; the whole process tree is killed at it.
      memory_mb: address-space limit of each process (Python itself needs ~20 MB).
      language: "python" (the system Python 3, standard library only) or "bash" (`/bin/bash`
        and the system's `/usr/bin` tools).
      files: extra files written next to the program in `/tmp` (never into the workspace),
        {relative path: text}; importable by a Python program run without a workspace.
      workspace: a `Workspace` (from `make_workspace`), unpacked into a fresh tmpfs at
        `/workspace` capped at its size and file count, the working directory. When the
        program has exited (or timed out), every process it started is killed and the
        workspace is packed back, replacing the archive (see `SandboxResult.workspace_error`).
        A Python program's `sys.path` is then the standard library only: neither the
        workspace nor `/tmp`.
      workspace_readonly: mount the workspace read-only and keep nothing of the run.
      max_procs: processes and threads the program may have at once.
      max_output_bytes: kept of stdout and of stderr each; the rest is discarded.
      file_size_mb: largest file the program may write.
      tmp_mb: size of the writable /tmp (and of /dev/shm).
      backend: "bwrap" (default) or "subprocess", the unsafe opt-in: no filesystem, network or
        process isolation, and no workspace. Defaults to `POSTTRAIN_SANDBOX` ("bwrap" or
        "unsafe-subprocess").

    Returns:
      A `SandboxResult`.

    Raises:
      SandboxUnavailableError: bwrap is missing or cannot create namespaces here, and the
        unsafe backend was not chosen; the message says how to install it.
      SandboxError: the container failed before the program started (a fault of the sandbox
        or the machine, never of the program).
      ValueError: an unsupported language or backend, a bad file name or a non-positive limit,
        or a workspace with the unsafe backend.
    """
    if language not in _MAINS:
        raise ValueError(f"sandbox language {language!r} is not supported; use 'python' or 'bash'")
    if workspace is not None and not isinstance(workspace, Workspace):
        raise ValueError(
            f"sandbox workspace {workspace!r} is not a Workspace; make one with make_workspace()"
        )
    if min(timeout_s, memory_mb, max_procs, file_size_mb, tmp_mb) <= 0 or max_output_bytes < 0:
        raise ValueError(
            f"sandbox limits must be positive: timeout_s={timeout_s}, memory_mb={memory_mb}, "
            f"max_procs={max_procs}, file_size_mb={file_size_mb}, tmp_mb={tmp_mb}, "
            f"max_output_bytes={max_output_bytes}"
        )
    main, files = _MAINS[language], {**(files or {})}
    for name in files:
        norm = os.path.normpath(name)
        if os.path.isabs(name) or norm.startswith("..") or norm in (".", main):
            raise ValueError(f"sandbox file name {name!r} must be a relative path, not {main}")
    files[main] = code
    program = (language, main, workspace, workspace_readonly)
    limits = [
        (resource.RLIMIT_AS, memory_mb << 20, memory_mb << 20),
        (resource.RLIMIT_CPU, int(timeout_s) + 1, int(timeout_s) + 2),
        (resource.RLIMIT_NOFILE, 256, 256),
        (resource.RLIMIT_FSIZE, file_size_mb << 20, file_size_mb << 20),
        (resource.RLIMIT_CORE, 0, 0),
    ]
    backend = backend or os.environ.get("POSTTRAIN_SANDBOX") or "bwrap"
    io = (stdin.encode(errors="replace"), timeout_s, max_output_bytes)
    if backend in _UNSAFE:
        if workspace is not None:
            raise ValueError(
                "a sandbox workspace needs the bwrap backend (its size cap, read-only mode and "
                f"process cleanup are the container's), not {backend!r}"
            )
        warnings.warn(
            "running untrusted code with the subprocess backend: rlimits (CPU, memory, file "
            "size, open files) and a timeout only; no filesystem or network isolation, no "
            "process-count limit, and children that leave the process group can outlive it. "
            "Install bubblewrap for real isolation.",
            UnsafeSandboxWarning,
            stacklevel=2,
        )
        return _run_subprocess(files, limits, io, program)
    if backend != "bwrap":
        raise ValueError(f"sandbox backend {backend!r}: use 'bwrap' or 'unsafe-subprocess'")
    limits.append((resource.RLIMIT_NPROC, max_procs, max_procs))
    return _run_bwrap(files, limits, tmp_mb << 20, io, program)


def _run_bwrap(files: dict[str, str], limits, tmp_bytes: int, io, program) -> SandboxResult:
    bwrap = _bw.find_bwrap()
    if bwrap is None:
        where = os.environ.get("POSTTRAIN_BWRAP") or "PATH"
        raise SandboxUnavailableError(
            f"refusing to run untrusted code: bubblewrap (bwrap) not found ({where}). "
            f"{_bw.INSTALL_HINT}; or opt into the weaker backend with backend='subprocess' / "
            "POSTTRAIN_SANDBOX=unsafe-subprocess (rlimits and a timeout only, no filesystem or "
            "network isolation)."
        )
    _bw.check_usable(bwrap)
    language, main, workspace, readonly = program
    fds, pass_fds, save = [], [], None
    try:
        for name, text in files.items():
            fd = os.memfd_create("posttrain-sandbox")
            fds.append((fd, f"{_bw.WORKDIR}/{name}"))
            data = memoryview(text.encode(errors="replace"))
            while data:
                data = data[os.write(fd, data) :]
            os.lseek(fd, 0, os.SEEK_SET)
        pass_fds = [fd for fd, _ in fds]
        config = {}
        if workspace is not None:
            config["archive_in"] = os.open(workspace.path, os.O_RDONLY | os.O_CLOEXEC)
            pass_fds.append(config["archive_in"])
            config["archive_out"] = None
            if not readonly:
                save = _Save(workspace)
                config["archive_out"] = save.pipe_w
        prefix, kwargs = _bw.privilege_drop()
        python = _bw.interpreter()[0]

        def argv_for(started_fd: int) -> list[str]:
            path = f"{_bw.WORKDIR}/{main}"
            if workspace is None:
                launcher = _launcher(language, started_fd, limits, path, [_bw.WORKDIR])
                command = [python, "-I", "-S", "-B", "-c", launcher]
            else:  # the supervisor applies the limits; bash needs no launcher then
                command = ["/bin/bash", path]
                if language == "python":
                    launcher = _launcher(language, None, [], path, [])
                    command = [python, "-I", "-S", "-B", "-c", launcher]
                size, inodes = workspace.size_mb << 20, workspace.max_files
                cfg = {**config, "ctl": started_fd, "size": size, "inodes": inodes}
                cfg.update(timeout=io[1], argv=command, limits=limits)
                command = [python, "-I", "-S", "-B", "-c", f"CONFIG = {cfg!r}\n{_bw.SUPERVISOR}"]
            return prefix + _bw.bwrap_argv(bwrap, fds, tmp_bytes, command, workspace is not None)

        extra = [save.pipe_w] if save else []
        kwargs.update(cwd="/", pass_fds=pass_fds + extra)
        return _execute(argv_for, "bwrap", io, workspace, save, **kwargs)
    finally:
        for fd in pass_fds:
            os.close(fd)
        if save is not None:
            save.close()


class _Save:
    """Where a read-write workspace run's new archive goes: a pipe from the container into
    `<archive>.next-XXXX`, kept only up to what the workspace's limits allow."""

    def __init__(self, workspace: Workspace):
        directory, name = os.path.split(workspace.path)
        fd, self.next = tempfile.mkstemp(prefix=name + _bw.NEXT, dir=directory)  # never a link
        self.workspace = workspace
        # Headers: 512 B each, more for long names (pax); 8 KiB per entry is ample.
        self.cap = (workspace.size_mb << 20) + workspace.max_files * 8192 + (1 << 20)
        self.file = os.fdopen(fd, "wb")  # closed by close()
        self.pipe_r, self.pipe_w = os.pipe()

    def close_write_end(self) -> None:
        """Once the container holds it."""
        if self.pipe_w is not None:
            os.close(self.pipe_w)
            self.pipe_w = None

    def close(self) -> None:
        """Closes the pipe and the file; removes the file unless `keep()` renamed it."""
        self.close_write_end()
        os.close(self.pipe_r)
        self.file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.next)

    def keep(self, sink: _Sink, report: dict, timed_out: bool) -> str | None:
        """Replaces the workspace's archive by the new one if it came whole; else says why not."""
        if timed_out and "code" not in report:
            return "the sandbox was killed before it saved the workspace"
        if "save_error" in report:
            return f"the workspace could not be saved: {report['save_error']}"
        if sink.truncated or report.get("saved") != sink.size:
            return f"the workspace's archive came incomplete ({sink.size} bytes)"
        self.file.close()
        os.replace(self.next, self.workspace.path)
        return None


def _run_subprocess(files: dict[str, str], limits, io, program) -> SandboxResult:
    with tempfile.TemporaryDirectory(prefix="posttrain-sandbox-") as tmp:
        for name, text in files.items():
            path = os.path.join(tmp, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8", errors="replace") as f:
                f.write(text)

        language, main = program[:2]

        def argv_for(started_fd: int) -> list[str]:
            launcher = _launcher(language, started_fd, limits, os.path.join(tmp, main), [tmp])
            return [_bw.interpreter()[0], "-I", "-S", "-B", "-c", launcher]

        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "LANG": "C.UTF-8"}
        return _execute(argv_for, "subprocess", io, cwd=tmp, env=env)


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


class SandboxPool:
    """Runs sandboxed executions concurrently, at most `max_workers` at a time.

    Threads suffice: each execution is a subprocess the thread only waits on.

    Example:
      with SandboxPool(4, timeout_s=5, memory_mb=256) as pool:
          results = pool.map(programs, stdins=inputs)
    """

    def __init__(self, max_workers: int, **defaults):
        """`defaults` are `run` keyword arguments applied to every execution."""
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="sandbox")
        self._defaults = defaults

    def submit(self, code: str, **kwargs) -> Future[SandboxResult]:
        """Schedules `run(code, **defaults, **kwargs)`."""
        return self._executor.submit(run, code, **{**self._defaults, **kwargs})

    def map(
        self, codes: Iterable[str], *, stdins: Iterable[str] | None = None, **kwargs
    ) -> list[SandboxResult]:
        """Runs every program (with the matching stdin, if given); results in input order."""
        codes = list(codes)
        stdins = [""] * len(codes) if stdins is None else list(stdins)
        if len(stdins) != len(codes):
            raise ValueError(f"{len(codes)} programs but {len(stdins)} stdins")
        futures = [self.submit(c, stdin=s, **kwargs) for c, s in zip(codes, stdins, strict=True)]
        return [f.result() for f in futures]

    def close(self) -> None:
        """Waits for running executions and drops queued ones."""
        self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
