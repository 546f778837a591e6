"""The bubblewrap (`bwrap`) container a sandboxed program runs in: interpreter, mounts, flags.

What the program sees: `/usr` (and the `/bin`, `/lib*` links into it) read-only, `/etc/ld.so.cache`
and `/etc/localtime` only, a fresh procfs for its own PID namespace, a minimal `/dev`, two
size-capped tmpfs mounts, `/tmp` (its working directory, holding `main.py` and the caller's files)
and `/dev/shm`, and, when the caller gives a `Workspace`, a third one at `/workspace` (then the
working directory) that `SUPERVISOR` mounts and fills from the workspace's archive, which it
reads from a file descriptor; everything else, `/` included, is read-only. The
project checkout, `/root`, `/home`, the host's `/tmp` and the host's environment variables are
absent. Every namespace is new (`--unshare-all`: user, PID, network, IPC, UTS, cgroup), so the
network is a loopback of its own, and nested user namespaces are refused (`--disable-userns`,
bubblewrap >= 0.8).

Interpreter: `/usr/bin/python3` (the system Python; it needs no bind beyond `/usr`). The
project's `.venv` lives inside the checkout, which must stay invisible, so `sys.executable` is
only the fallback where there is no system Python, and then its install prefix (not the venv) is
bound read-only. `POSTTRAIN_SANDBOX_PYTHON` picks another interpreter the same way. The program
gets the standard library only (`-I -S`: no site-packages, no user site, no environment).

Run as root, bwrap is dropped to uid 65534 (`setpriv`) before it starts: a sandbox mapped to host
uid 0 would keep root's exemption from `RLIMIT_NPROC` (the fork-bomb guard) and, without a user
namespace, all of root's capabilities inside.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass

SANDBOX_UID = 65534  # "nobody": the host uid sandboxes run under when the caller is root
WORKDIR = "/tmp"  # the program's working directory and only writable tree (with /dev/shm)
WORKSPACE = "/workspace"  # where a workspace is bound (then the working directory instead)
SYSTEM_PYTHON = "/usr/bin/python3"
INSTALL_HINT = (
    "install bubblewrap (Debian/Ubuntu: `apt-get install -y bubblewrap`; Fedora: `dnf install "
    "bubblewrap`) or set POSTTRAIN_BWRAP to its path"
)


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program in it)."""


class SandboxUnavailableError(SandboxError):
    """bwrap is missing or cannot create namespaces here, and no weaker backend was opted into."""


def find_bwrap() -> str | None:
    """The bwrap binary: `POSTTRAIN_BWRAP` if set (even if it does not exist), else on PATH."""
    path = os.environ.get("POSTTRAIN_BWRAP")
    if path:
        return path if os.access(path, os.X_OK) else None
    return shutil.which("bwrap")


def interpreter() -> tuple[str, tuple[str, ...]]:
    """(Python to run inside, host directories outside /usr it needs bound read-only)."""
    python = os.environ.get("POSTTRAIN_SANDBOX_PYTHON")
    if not python:
        python = SYSTEM_PYTHON if os.path.exists(SYSTEM_PYTHON) else sys._base_executable
    real = os.path.realpath(python)
    if not os.access(real, os.X_OK):
        raise SandboxError(
            f"the sandbox's Python {python} does not exist; install python3 or point "
            "POSTTRAIN_SANDBOX_PYTHON at a Python 3 interpreter"
        )
    if real.startswith("/usr/"):
        return python, ()
    # An interpreter outside /usr (pyenv, conda): bind its install prefix, bin/ and lib/.
    return real, (os.path.dirname(os.path.dirname(real)),)


@functools.cache
def _features(bwrap: str) -> frozenset[str]:
    out = subprocess.run([bwrap, "--help"], capture_output=True, text=True, check=False)
    text = out.stdout + out.stderr
    flags = ("--disable-userns", "--size", "--perms", "--as-pid-1", "--cap-add")
    return frozenset(f for f in flags if f in text)


def privilege_drop() -> tuple[list[str], dict]:
    """(argv prefix, Popen kwargs) that start bwrap as `SANDBOX_UID` when the caller is root."""
    if os.geteuid() != 0:
        return [], {}
    setpriv = shutil.which("setpriv", path="/usr/bin:/bin")
    if setpriv:  # keeps Popen on its vfork path: forking a multi-GB trainer is slow
        uid = str(SANDBOX_UID)
        return [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups"], {}
    return [], {"user": SANDBOX_UID, "group": SANDBOX_UID, "extra_groups": []}


def bwrap_argv(
    bwrap: str,
    files: list[tuple[int, str]],
    tmp_bytes: int,
    command: list[str],
    workspace: bool = False,
) -> list[str]:
    """The bwrap command line that runs `command` in a fresh container.

    Args:
      bwrap: the bwrap binary.
      files: (readable fd, path inside) pairs copied into the container's tmpfs.
      tmp_bytes: size cap of each tmpfs (/tmp and /dev/shm).
      command: argv inside the container.
      workspace: `command` is `SUPERVISOR`: it runs as the container's PID 1 with
        CAP_SYS_ADMIN in the container's user namespace (to mount the workspace), in
        WORKSPACE, an empty directory it mounts a tmpfs on.
    """
    feats = _features(bwrap)
    if workspace and not {"--as-pid-1", "--cap-add"} <= feats:
        raise SandboxUnavailableError(
            f"bubblewrap at {bwrap} lacks --as-pid-1 or --cap-add, which a workspace needs; "
            "install bubblewrap >= 0.5 (not setuid)"
        )
    size = ["--size", str(tmp_bytes)] if "--size" in feats else []
    argv = [bwrap, "--unshare-all", "--unshare-user", "--die-with-parent"]
    if "--disable-userns" in feats:
        argv.append("--disable-userns")
    if workspace:
        argv += ["--as-pid-1", "--cap-add", "CAP_SYS_ADMIN"]
    argv += ["--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for d in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            argv += ["--ro-bind", d, d]
    for d in interpreter()[1]:
        argv += ["--ro-bind", d, d]
    for f in ("/etc/ld.so.cache", "/etc/localtime"):
        argv += ["--ro-bind-try", f, f]
    argv += [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        *size,
        "--tmpfs",
        "/dev/shm",
        "--remount-ro",
        "/dev",
    ]
    argv += [*size, *(["--perms", "1777"] if "--perms" in feats else []), "--tmpfs", WORKDIR]
    for fd, dest in files:
        argv += ["--file", str(fd), dest]
    if workspace:
        argv += ["--dir", WORKSPACE]
    cwd = WORKSPACE if workspace else WORKDIR
    argv += ["--remount-ro", "/", "--chdir", cwd, "--clearenv"]
    for key, value in (("PATH", "/usr/bin:/bin"), ("HOME", WORKDIR), ("LANG", "C.UTF-8")):
        argv += ["--setenv", key, value]
    return [*argv, "--", *command]


@functools.cache
def check_usable(bwrap: str) -> None:
    """Starts one empty container (once per process); raises where namespaces are refused."""
    prefix, kwargs = privilege_drop()
    python = interpreter()[0]
    argv = prefix + bwrap_argv(bwrap, [], 1 << 20, [python, "-I", "-S", "-c", "pass"])
    out = subprocess.run(argv, capture_output=True, text=True, env={}, cwd="/", **kwargs)
    if out.returncode != 0:
        raise SandboxUnavailableError(
            f"bubblewrap at {bwrap} cannot start a sandbox here (exit {out.returncode}: "
            f"{out.stderr.strip()[:500]}). Usually user namespaces are off: it needs "
            "unprivileged ones (sysctl kernel.unprivileged_userns_clone=1; Ubuntu >= 23.10 also "
            "kernel.apparmor_restrict_unprivileged_userns=0), or opt into the weaker backend "
            "with backend='subprocess' / POSTTRAIN_SANDBOX=unsafe-subprocess."
        )


@dataclass(frozen=True)
class Workspace:
    """A sandbox's persistent `/workspace`, kept between runs as a tar archive on the host.

    Each run unpacks it into a fresh tmpfs of `size_mb` holding at most `max_files` entries, so
    a write past either limit fails inside the sandbox (ENOSPC); after the run's processes are
    all dead, the tmpfs is packed back into a new archive that replaces this one.
    """

    path: str  # the archive (root-only when the caller is root: the sandbox gets it by fd)
    size_mb: int  # the tmpfs's size, and the most file data an archive may hold
    max_files: int  # the tmpfs's inodes (files, directories, links), the root excluded

    def files(self) -> dict[str, bytes]:
        """{relative path: content} of its regular files (read from the archive, on the host)."""
        with tarfile.open(self.path, "r:") as tar:
            return {m.name: tar.extractfile(m).read() for m in tar if m.isreg()}

    def members(self) -> dict[str, tarfile.TarInfo]:
        """{relative path: its tar header} of every entry (type, mode, link target, size)."""
        with tarfile.open(self.path, "r:") as tar:
            return {m.name: m for m in tar}


def make_workspace(
    files: Mapping[str, str] | None = None,
    root: str | None = None,
    *,
    size_mb: int = 256,
    max_files: int = 10_000,
) -> Workspace:
    """A new `Workspace` holding `files` ({relative path: text}), its archive made in `root`
    (default: the system temp dir)."""
    if size_mb <= 0 or max_files <= 0:
        raise ValueError(f"workspace limits must be positive: {size_mb=}, {max_files=}")
    names = {}
    for name in files or {}:
        norm = os.path.normpath(name) if isinstance(name, str) else ""
        if not norm or os.path.isabs(name) or norm == "." or norm.split(os.sep)[0] == "..":
            raise ValueError(
                f"workspace file name {name!r} must be a relative path inside the workspace "
                "(no leading '/', no '..')"
            )
        names[norm] = files[name].encode(errors="replace")
    dirs = sorted({d for n in names for d in _ancestors(n)[:-1] if d})
    pages = sum(-(-len(data) // 4096) * 4096 for data in names.values())  # tmpfs rounds up
    if pages > size_mb << 20 or len(dirs) + len(names) > max_files:
        raise ValueError(
            f"a workspace's files ({len(names)} files, {pages >> 10} KiB in pages) do not fit "
            f"its limits ({size_mb} MB, {max_files} files): raise them or give fewer files"
        )
    fd, path = tempfile.mkstemp(prefix="posttrain-ws-", suffix=".tar", dir=root)
    try:
        now = time.time()
        with os.fdopen(fd, "wb") as f, tarfile.open(fileobj=f, mode="w", format=PAX) as tar:
            for d in dirs:
                tar.addfile(_member(d, tarfile.DIRTYPE, 0o755, now))
            for name, data in names.items():
                info = _member(name, tarfile.REGTYPE, 0o644, now)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    except BaseException:
        remove_workspace(Workspace(path, size_mb, max_files))
        raise
    return Workspace(path, size_mb, max_files)


def remove_workspace(workspace: Workspace) -> None:
    """Deletes a workspace's archive (and half-written next ones); a no-op if gone."""
    for path in [workspace.path, *glob.glob(glob.escape(workspace.path + NEXT) + "*")]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


NEXT = ".next-"  # prefix (after the archive's name) of the new archives runs write
PAX = tarfile.PAX_FORMAT


def _member(name: str, kind: bytes, mode: int, mtime: float) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.mtime = kind, mode, mtime
    return info


def _ancestors(path: str) -> list[str]:
    """path's directories, nearest first, then ''."""
    out = []
    while path:
        path = os.path.dirname(path)
        out.append(path)
    return out


# The container's PID 1 in a workspace run (`python3 -I -S -B -c "CONFIG = {...}" + this`),
# trusted: it holds CAP_SYS_ADMIN in the container's user namespace (bwrap --cap-add) only until
# the workspace is mounted. It makes itself undumpable (the program, same uid, can neither ptrace
# it nor open its /proc/1/fd), ignores the signals a process in its PID namespace can send it,
# mounts a tmpfs of the workspace's size and inodes on /workspace in a mount namespace of its
# own, unpacks the archive (fd `archive_in`), remounts it read-only when asked, drops every
# capability, then forks and execs `argv` under `limits` (rlimits). Once argv's process exits,
# or at the deadline, it kills every other process of the namespace (kill(-1) from its init
# spares only the init), reaps them, packs the workspace to `archive_out` and writes the outcome
# (a dict's repr) on `ctl` after a b"1" that says the program started.
SUPERVISOR = r"""
import ctypes, os, resource, signal, tarfile, time

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND = 1, 2, 4, 32, 4096


class SaveError(Exception):
    pass


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("effective", "permitted", "inheritable")]


def check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def safe_name(name):
    norm = os.path.normpath(name)
    if norm.startswith("/") or norm == ".." or norm.startswith("../"):
        raise ValueError(f"archive member {name!r} is outside the workspace")
    return norm


def unpack(fd):
    dirs, links = [], set()
    with os.fdopen(fd, "rb") as f, tarfile.open(fileobj=f, mode="r|") as tar:
        for m in tar:
            name = safe_name(m.name)
            if name == ".":
                continue
            parts = name.split("/")
            if any("/".join(parts[:i]) in links for i in range(1, len(parts))):
                raise ValueError(f"archive member {name!r} is under a symlink")
            if len(parts) > 1:
                os.makedirs(os.path.dirname(name), exist_ok=True)
            if m.isdir():
                os.makedirs(name, exist_ok=True)
                dirs.append((name, m))
            elif m.isreg():
                src = tar.extractfile(m)
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                with os.fdopen(os.open(name, flags, 0o600), "wb") as out:
                    while chunk := src.read(1 << 20):
                        out.write(chunk)
                os.chmod(name, m.mode & 0o7777)
                os.utime(name, (m.mtime, m.mtime))
            elif m.issym():
                os.symlink(m.linkname, name)
                os.utime(name, (m.mtime, m.mtime), follow_symlinks=False)
                links.add(name)
            elif m.islnk():
                os.link(safe_name(m.linkname), name, follow_symlinks=False)
            elif m.isfifo():
                os.mkfifo(name, m.mode & 0o777)
    for name, m in reversed(dirs):  # children before parents: a 0o555 dir was filled first
        os.chmod(name, m.mode & 0o7777)
        os.utime(name, (m.mtime, m.mtime))


class Out:
    def __init__(self, fd):
        self.fd, self.n = fd, 0

    def write(self, data):
        view = memoryview(data)
        while view:
            k = os.write(self.fd, view)
            view, self.n = view[k:], self.n + k


def pack(fd):
    out, count, total = Out(fd), 0, 0
    mode = os.lstat(".").st_mode
    os.chmod(".", mode | 0o700)
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        stack = ["."]
        while stack:  # parents are archived before their children
            d = stack.pop()
            for name in sorted(os.listdir(d)):
                path = f"{d}/{name}"
                info = tar.gettarinfo(path, path[2:])
                if info is None:  # a socket: nothing to keep
                    continue
                count += 1
                # What it takes in the next run's tmpfs: whole pages, sparse files written out,
                # long symlink targets a page each.
                if info.isreg():
                    total += -(-info.size // 4096) * 4096
                elif info.issym() and len(info.linkname.encode()) >= 128:
                    total += 4096
                if count > CONFIG["inodes"]:
                    raise SaveError(f"it holds more than {CONFIG['inodes']} files")
                if total > CONFIG["size"]:
                    raise SaveError(
                        f"its files hold more than {CONFIG['size'] >> 20} MB (in 4 KiB pages; "
                        "sparse files count at their full size)"
                    )
                if info.isreg():
                    if not info.mode & 0o400:
                        os.chmod(path, info.mode | 0o400)
                    with open(path, "rb") as f:
                        tar.addfile(info, f)
                    continue
                tar.addfile(info)
                if info.isdir():
                    if info.mode & 0o500 != 0o500:
                        os.chmod(path, info.mode | 0o700)
                    stack.append(path)
    return out.n


def kill_all():
    while True:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def run(argv, timeout):
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    deadline = time.monotonic() + timeout
    pid = os.fork()
    if pid == 0:
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, set())
            for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # ignored by Python, not by programs
                signal.signal(sig, signal.SIG_DFL)
            for kind, soft, hard in CONFIG["limits"]:
                resource.setrlimit(kind, (soft, hard))
            os.execv(argv[0], argv)
        finally:
            os._exit(127)
    status = None
    while True:
        while True:  # reap what exited: the program, and orphans reparented to this init
            try:
                p, st = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                p = 0
            if p == 0:
                break
            if p == pid:
                status = os.waitstatus_to_exitcode(st)
        left = deadline - time.monotonic()
        if status is not None or left <= 0:
            break
        signal.sigtimedwait({signal.SIGCHLD}, left)
    kill_all()
    return status


def main():
    ctl = CONFIG["ctl"]
    os.set_inheritable(ctl, False)
    if CONFIG["archive_out"] is not None:
        os.set_inheritable(CONFIG["archive_out"], False)
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # init gets no signal it has no handler for
        check(libc.prctl(4, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE, 0)")
        check(libc.unshare(0x00020000), "unshare(CLONE_NEWNS)")
        opts = f"size={CONFIG['size']},nr_inodes={CONFIG['inodes'] + 1},mode=755"
        check(libc.mount(b"tmpfs", b"/workspace", b"tmpfs", MS_NOSUID | MS_NODEV, opts.encode()),
              "mount the workspace's tmpfs")
        os.chdir("/workspace")
        unpack(CONFIG["archive_in"])
        if CONFIG["archive_out"] is None:
            flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
            check(libc.mount(None, b"/workspace", None, flags, None), "remount read-only")
        check(libc.capset(ctypes.byref(CapHeader(0x20080522, 0)), (CapData * 2)()), "capset")
    except Exception as e:
        os.write(ctl, repr({"error": f"{type(e).__name__}: {e}"}).encode())
        raise SystemExit(1)
    os.write(ctl, b"1")
    try:
        report = {"code": run(CONFIG["argv"], CONFIG["timeout"])}
        if CONFIG["archive_out"] is not None:
            try:
                report["saved"] = pack(CONFIG["archive_out"])
            except (SaveError, OSError, tarfile.TarError) as e:
                report["save_error"] = str(e) if isinstance(e, SaveError) else repr(e)
    except Exception as e:
        report = {"error": f"{type(e).__name__}: {e}"}
    os.write(ctl, repr(report).encode())


main()
"""
