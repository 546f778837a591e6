"""The bubblewrap (`bwrap`) container a sandboxed program runs in: interpreter, mounts, flags.

What the program sees: `/usr` (and the `/bin`, `/lib*` links into it) read-only, `/etc/ld.so.cache`
and `/etc/localtime` only (and, when the caller names `tools`, those host executables
read-only in `/opt/tools`), a fresh procfs for its own PID namespace, a minimal `/dev`, two
size-capped tmpfs mounts, `/tmp` (its working directory, holding `main.py` and the caller's files)
and `/dev/shm`, and, when the caller gives a `Workspace`, a third one at `/workspace` (then the
working directory) that `_sandbox_workspace.SUPERVISOR` mounts and fills from the workspace's
archive, which it
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

import functools
import os
import shutil
import subprocess
import sys

SANDBOX_UID = 65534  # "nobody": the host uid sandboxes run under when the caller is root
WORKDIR = "/tmp"  # the program's working directory and only writable tree (with /dev/shm)
WORKSPACE = "/workspace"  # where a workspace is bound (then the working directory instead)
TOOLS = "/opt/tools"  # host executables a run asks for (`tools`), read-only, first on PATH
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
    tools: dict[str, str] | None = None,
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
      tools: {name: host executable}, each bound read-only at TOOLS/<name>, which heads PATH.
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
    for name, host in (tools or {}).items():
        argv += ["--ro-bind", os.path.realpath(host), f"{TOOLS}/{name}"]
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
    path = f"{TOOLS}:/usr/bin:/bin" if tools else "/usr/bin:/bin"
    for key, value in (("PATH", path), ("HOME", WORKDIR), ("LANG", "C.UTF-8")):
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
