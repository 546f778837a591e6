"""Builds and measures a script's part under hard limits, in a child process the host can kill.

A tree within the caps of `_cad_kernel.check` can still describe more geometry than the host
should build (three hundred 256-facet spheres), so the kernel never runs on an untrusted tree in
the caller's process. Each build runs in a fresh child forked from a helper process (started
once per process, on first use, from a clean interpreter that has imported the kernel but run
nothing: forking the caller itself could deadlock on its threads, JAX's or the kernel's own),
under:

- a wall-clock deadline (`timeout_s`): the caller SIGKILLs the child at it, and the child's own
  alarm kills it a second later should the caller be gone;
- an address-space limit (`RLIMIT_AS`) of `memory_mb` above what the child starts with (plus
  8 MB of thread stack per CPU for the kernel's worker threads), so an allocation past it fails
  in the child (MemoryError, or a crash of the kernel) and nowhere else. It also bounds the mesh
  that comes back, and so what the caller does with it afterwards (a render: 256 MB holds
  about 260,000 triangles, which render in ~4 s).

The child sends back the measurements (`_cad_geometry.measure`), the IoU with a target if one
was given, and the part's mesh, as JSON and raw arrays (never pickle: the child ran the kernel
on untrusted input). The helper exits when the caller closes its end or dies; with it in the
caller's process group, a reward worker killed at its deadline takes it and its children along.
The child bounds resources, it is no security boundary: it runs the kernel with the caller's
privileges, on a tree that is JSON checked against the caps (the script itself never leaves the
sandbox).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import resource
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np

from posttrain.rewards._cad_geometry import Measurements, iou, measure
from posttrain.rewards._cad_kernel import CADError, build, check

STACK_PER_CPU_MB = 8  # address space allowed per CPU for the kernel's worker threads' stacks


@dataclasses.dataclass(frozen=True)
class Built:
    """What building a tree under the limits gave: the part, or why there is none."""

    solid: object | None  # manifold3d.Manifold, rebuilt in this process from the child's mesh
    measurements: Measurements | None  # measured in the child
    iou: float | None  # with the target, when one was given and the part is valid
    error: str  # "" when the part was built
    timed_out: bool = False  # stopped at the deadline


def build_limited(
    tree: dict, *, timeout_s: float, memory_mb: int, target: dict | None = None
) -> Built:
    """Builds `tree` in a child process under a deadline and a memory limit and measures it.

    Args:
      tree: the part's construction tree (checked against the caps first, in this process).
      timeout_s: wall-clock seconds for building and measuring (and the IoU).
      memory_mb: address space the child may add to what it starts with.
      target: a trusted construction tree to compute the part's IoU with.

    Returns:
      A `Built`; its error says which limit stopped the build, if one did.
    """
    import manifold3d as m3d

    try:
        check(tree)  # the cheap refusals, without a process
    except CADError as e:
        return Built(None, None, None, str(e))
    request = json.dumps({"tree": tree, "target": target, "timeout_s": timeout_s,
                          "memory_mb": memory_mb}).encode()  # fmt: skip
    deadline = time.monotonic() + timeout_s
    host, child = socket.socketpair()
    pid, done = None, False
    try:
        with _LOCK:
            socket.send_fds(_helper(), [b"b"], [child.fileno()])
        child.close()
        pid = struct.unpack("<q", _recv_exactly(host, 8, deadline))[0]
        host.settimeout(max(deadline - time.monotonic(), 0.001))
        host.sendall(struct.pack("<q", len(request)) + request)
        header = json.loads(_recv_message(host, deadline))
        arrays = [_recv_message(host, deadline) for _ in range(header["arrays"])]
        done = True
    except TimeoutError:
        error = f"building the part took longer than {timeout_s:.3g} s"
        return Built(None, None, None, error, timed_out=True)
    except (OSError, EOFError, ValueError, KeyError):  # it died without a (whole) answer
        return Built(None, None, None, "building the part failed: its process died")
    finally:
        if pid is not None and not done:
            _kill(pid)
        host.close()
        child.close()
    if header["status"] == "memory":
        return Built(None, None, None, f"building the part needed more than {memory_mb} MB")
    if header["status"] == "died":  # the kernel crashes, rather than raise, on some allocations
        error = (f"building the part crashed the geometry kernel ({header['how']}), as running "
                 f"out of its {memory_mb} MB does")  # fmt: skip
        return Built(None, None, None, error)
    if header["status"] != "ok":
        return Built(None, None, None, header["error"])
    verts = np.frombuffer(arrays[0], np.float64).reshape(-1, 3)
    tris = np.frombuffer(arrays[1], np.uint64).reshape(-1, 3)
    try:
        solid = m3d.Manifold(m3d.Mesh64(vert_properties=verts.copy(), tri_verts=tris.copy()))
    except Exception as e:  # (the kernel made this mesh; it never fails to take it back)
        return Built(None, None, None, f"building the part failed: its mesh came back bad ({e})")
    m = header["measurements"]
    measurements = Measurements(**{k: tuple(v) if isinstance(v, list) else v for k, v in m.items()})
    return Built(solid, measurements, header["iou"], "")


def _kill(pid: int) -> None:
    """SIGKILLs a child that may have exited already (the helper reaps it at once)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _recv_exactly(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        sock.settimeout(remaining)
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError("connection closed")
        buf += chunk
    return bytes(buf)


def _recv_message(sock: socket.socket, deadline: float) -> bytes:
    (n,) = struct.unpack("<q", _recv_exactly(sock, 8, deadline))
    return _recv_exactly(sock, n, deadline)


# --- the helper process and its children ---------------------------------------------------

_LOCK = threading.Lock()
_HELPER: dict = {}  # {"pid": this process's pid, "proc": Popen, "ctrl": socket}


def _helper() -> socket.socket:
    """The control socket of this process's helper, started (again) if need be."""
    proc = _HELPER.get("proc")
    if _HELPER.get("pid") == os.getpid() and proc is not None and proc.poll() is None:
        return _HELPER["ctrl"]
    if _HELPER.get("ctrl") is not None:
        _HELPER["ctrl"].close()
    ctrl, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    code = (
        f"import sys; sys.path[:] = {sys.path!r}; "
        f"from posttrain.rewards._cad_builder import serve; serve({theirs.fileno()})"
    )
    # One malloc arena: the kernel's worker threads would each reserve 64 MB of address space.
    env = {**os.environ, "MALLOC_ARENA_MAX": "1", "OPENBLAS_NUM_THREADS": "1",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        pass_fds=[theirs.fileno()],
        env=env,
    )
    theirs.close()
    _HELPER.update(pid=os.getpid(), proc=proc, ctrl=ctrl)
    return ctrl


def serve(ctrl_fd: int) -> None:
    """The helper's loop: for each socket the caller passes, fork a child that builds on it;
    when a child dies without answering, say how on its socket."""
    import manifold3d  # noqa: F401  (imported once here, not in every child)
    import scipy.sparse.csgraph  # noqa: F401  (_cad_holes)
    import scipy.spatial  # noqa: F401  (_cad_geometry)

    ctrl = socket.socket(fileno=ctrl_fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (the wakeup fd is what matters)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's; EOF ends this loop
    children: dict[int, int] = {}  # pid -> its socket
    with selectors.DefaultSelector() as selector:
        selector.register(ctrl, selectors.EVENT_READ)
        selector.register(wake_r, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                if key.fileobj is not ctrl:
                    with contextlib.suppress(OSError):
                        os.read(wake_r, 1 << 10)
                    _reap(children)
                    continue
                try:
                    _, fds, _, _ = socket.recv_fds(ctrl, 1, 1)
                except OSError:
                    return
                if not fds:  # the caller closed its end (or exited)
                    return
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    code = 1
                    try:
                        for fd in [ctrl.detach(), wake_r, wake_w, *children.values()]:
                            os.close(fd)  # (the other builds' sockets are not this one's)
                        _child(socket.socket(fileno=fds[0]))
                        code = 0
                    finally:
                        os._exit(code)
                children[pid] = fds[0]


def _reap(children: dict[int, int]) -> None:
    """Waits for the children that exited; one that died tells its caller how."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        fd = children.pop(pid, None)
        if fd is None:
            continue
        if not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
            how = (signal.Signals(os.WTERMSIG(status)).name if os.WIFSIGNALED(status)
                   else f"exit code {os.WEXITSTATUS(status)}")  # fmt: skip
            frame = json.dumps({"status": "died", "how": how, "arrays": 0}).encode()
            with contextlib.suppress(OSError):
                os.set_blocking(fd, False)
                os.write(fd, struct.pack("<q", len(frame)) + frame)
        os.close(fd)


def _child(sock: socket.socket) -> None:
    """In the forked child: read the request, set the limits, build, measure, reply."""
    sock.sendall(struct.pack("<q", os.getpid()))
    request = json.loads(_recv_message(sock, time.monotonic() + 60))
    signal.alarm(math.ceil(request["timeout_s"]) + 1)  # dies on its own if the caller is gone
    with open("/proc/self/status") as f:
        vm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    stacks = STACK_PER_CPU_MB * len(os.sched_getaffinity(0))
    limit = (vm_kb << 10) + ((request["memory_mb"] + stacks) << 20)
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    limit = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    arrays: list[bytes] = []
    try:
        header, arrays = _work(request["tree"], request["target"])
    except MemoryError:
        header = {"status": "memory"}
    except CADError as e:
        header = {"status": "error", "error": str(e)}
    except Exception as e:  # the kernel refused the geometry
        header = {"status": "error", "error": f"building the part failed: {e}"[:500]}
    header["arrays"] = len(arrays)
    parts = [json.dumps(header).encode(), *arrays]
    sock.sendall(b"".join(struct.pack("<q", len(p)) + p for p in parts))


def _work(tree: dict, target: dict | None) -> tuple[dict, list[bytes]]:
    solid = build(tree)
    m = measure(solid)
    fit = iou(solid, build(target)) if target is not None and m.valid else None
    mesh = solid.to_mesh64()
    verts = np.ascontiguousarray(np.asarray(mesh.vert_properties, np.float64)[:, :3])
    tris = np.ascontiguousarray(np.asarray(mesh.tri_verts, np.uint64))
    header = {"status": "ok", "measurements": dataclasses.asdict(m), "iou": fit}
    return header, [verts.tobytes(), tris.tobytes()]
