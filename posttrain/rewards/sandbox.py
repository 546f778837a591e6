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
container's PID 1 is a trusted supervisor (`_sandbox_workspace.SUPERVISOR`) that mounts a fresh
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

import os
import resource
import tempfile
import warnings
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import posttrain.rewards._sandbox_bwrap as _bw
from posttrain.rewards._sandbox_bwrap import SandboxError, SandboxUnavailableError
from posttrain.rewards._sandbox_process import SandboxResult, _execute, _launcher
from posttrain.rewards._sandbox_workspace import (
    SUPERVISOR,
    Workspace,
    _Save,
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
    "interpreter",
    "run",
]

_UNSAFE = ("subprocess", "unsafe-subprocess")


def interpreter() -> str:
    """The Python the sandbox runs programs with (`POSTTRAIN_SANDBOX_PYTHON`, else the system's)."""
    return _bw.interpreter()[0]


_MAINS = {"python": "main.py", "bash": "main.sh"}


class UnsafeSandboxWarning(UserWarning):
    """Untrusted code runs under the subprocess backend: rlimits and a timeout only."""


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
    tools: Mapping[str, str] | None = None,
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
      tools: host executables the program may run, {name: path}: each is bound read-only at
        `/opt/tools/<name>`, first on PATH (a linter, say; a static binary or one that needs
        only what `/usr` and `/lib` hold).

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
    tools = dict(tools or {})
    for name, host in tools.items():
        if not (name and name.replace("-", "").replace("_", "").replace(".", "").isalnum()):
            raise ValueError(f"sandbox tool name {name!r}: letters, digits, '-', '_', '.' only")
        if not (os.path.isfile(host) and os.access(host, os.X_OK)):
            raise ValueError(f"sandbox tool {name!r}: {host} is not an executable file")
    for name in files:
        norm = os.path.normpath(name)
        if os.path.isabs(name) or norm.startswith("..") or norm in (".", main):
            raise ValueError(f"sandbox file name {name!r} must be a relative path, not {main}")
    files[main] = code
    program = (language, main, workspace, workspace_readonly, tools)
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
    language, main, workspace, readonly, tools = program
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
                command = [python, "-I", "-S", "-B", "-c", f"CONFIG = {cfg!r}\n{SUPERVISOR}"]
            argv = _bw.bwrap_argv(bwrap, fds, tmp_bytes, command, workspace is not None, tools)
            return prefix + argv

        extra = [save.pipe_w] if save else []
        kwargs.update(cwd="/", pass_fds=pass_fds + extra)
        return _execute(argv_for, "bwrap", io, workspace, save, **kwargs)
    finally:
        for fd in pass_fds:
            os.close(fd)
        if save is not None:
            save.close()


def _run_subprocess(files: dict[str, str], limits, io, program) -> SandboxResult:
    with tempfile.TemporaryDirectory(prefix="posttrain-sandbox-") as tmp:
        for name, text in files.items():
            path = os.path.join(tmp, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8", errors="replace") as f:
                f.write(text)

        language, main, tools = program[0], program[1], program[4]
        bin_dir = os.path.join(tmp, ".tools")
        os.makedirs(bin_dir)
        for name, host in tools.items():
            os.symlink(os.path.realpath(host), os.path.join(bin_dir, name))

        def argv_for(started_fd: int) -> list[str]:
            launcher = _launcher(language, started_fd, limits, os.path.join(tmp, main), [tmp])
            return [_bw.interpreter()[0], "-I", "-S", "-B", "-c", launcher]

        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": tmp, "LANG": "C.UTF-8"}
        return _execute(argv_for, "subprocess", io, cwd=tmp, env=env)


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
