"""A sandbox's persistent `/workspace` (an episode's files), kept on the host as a tar archive
between runs, and the trusted supervisor that mounts it inside the container.

A run unpacks the archive into a fresh tmpfs capped at the workspace's size and inode count (a
write past either fails with ENOSPC inside), runs the program, kills every process it started
once it exits, and only then packs the tmpfs into a new archive (`_Save`), which replaces the
old one when it came whole.
"""

from __future__ import annotations

import contextlib
import glob
import io
import os
import tarfile
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass


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


class _Save:
    """Where a read-write workspace run's new archive goes: a pipe from the container into
    `<archive>.next-XXXX`, kept only up to what the workspace's limits allow."""

    def __init__(self, workspace: Workspace):
        directory, name = os.path.split(workspace.path)
        fd, self.next = tempfile.mkstemp(prefix=name + NEXT, dir=directory)  # never a link
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

    def keep(self, sink, report: dict, timed_out: bool) -> str | None:
        """Replaces the workspace's archive by the new one if it came whole (`sink`: what the
        pipe brought); else says why not."""
        if timed_out and "code" not in report:
            return "the sandbox was killed before it saved the workspace"
        if "save_error" in report:
            return f"the workspace could not be saved: {report['save_error']}"
        if sink.truncated or report.get("saved") != sink.size:
            return f"the workspace's archive came incomplete ({sink.size} bytes)"
        self.file.close()
        os.replace(self.next, self.workspace.path)
        return None


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
