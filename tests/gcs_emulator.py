"""A GCS emulator for tests: gcp-storage-emulator in memory, in its own process, on a free port.

`python -m tests.gcs_emulator BUCKET` prints the port once it serves. Tests reach it only through
`STORAGE_EMULATOR_HOST`, as a user would reach any emulator or GCS itself.

`start(bucket, stats=FILE)` also counts what each client process downloads: a line
`PID BYTES` per object download (a byte range counts its length) is appended to FILE, the PID
found from the client's socket among the processes the test started (`downloaded_bytes(FILE)`
sums them), so a test can check what
each process read independently of the reader's own count.

The emulator leaves out the `x-goog-generation` header of object downloads, which GCS sends and
tensorstore (Orbax's array writer) needs for its conditional writes; it is added here, so the
emulator answers as GCS does.
"""

import os
import re
import socket
import subprocess
import sys
import threading
import time

from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

_download = objects.download
_STATS: str | None = None  # where the emulator process appends "PID BYTES" per download
_lock = threading.Lock()


def _download_with_generation(request, response, storage, *args, **kwargs):
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        response["x-goog-generation"] = obj["generation"]
        response["x-goog-metageneration"] = obj["metageneration"]
        if _STATS:
            _count(request, int(obj["size"]))
    except NotFound:
        pass  # no such object: the emulator's own download answers 404
    return _download(request, response, storage, *args, **kwargs)


def _count(request, size: int) -> None:
    """Appends the downloading process's pid and the bytes it gets (as the emulator serves
    ranges: `bytes=START-[END]`, END inclusive and clipped to the object)."""
    nbytes = size
    match = re.fullmatch(r"\s*bytes=(\d+)-(\d*)", request.get_header("range", "") or "")
    if match:
        start = int(match[1])
        end = min(size, int(match[2]) + 1) if match[2] else size
        nbytes = max(0, end - start)
    # The pid is looked up once per connection (its handler), never per (host, port): a port
    # that one process closed can be the next port of the other (seen: a process's downloads
    # counted as its peer's).
    handler = request._request_handler  # noqa: SLF001
    with _lock:
        pid = getattr(handler, "_client_pid", None)
        if pid is None:
            pid = handler._client_pid = _client_pid(tuple(handler.client_address[:2]))
        with open(_STATS, "a") as f:
            f.write(f"{pid} {nbytes}\n")


def _client_pid(client: tuple) -> int:
    """The pid of the process that owns the socket bound to `client` (host, port): the socket's
    inode from /proc/net/tcp, then the test's processes (this one's parent and its children)
    searched for it; -1 if none has it."""
    port = f"{client[1]:04X}"
    inode = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                # The live socket (state 01, ESTABLISHED): an old one in TIME_WAIT has inode 0.
                if fields[1].rsplit(":", 1)[1] == port and fields[3] == "01" and fields[9] != "0":
                    inode = fields[9]
                    break
        if inode:
            break
    if inode is None:
        return -1
    target = f"socket:[{inode}]"
    for refresh in (False, True):
        for pid in _candidates(refresh):
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                        return pid
                except OSError:
                    continue
    return -1


_family: list[int] = []


def _candidates(refresh: bool) -> list[int]:
    """The test process (this one's parent) and its other children."""
    if refresh or not _family:
        import psutil

        parent = psutil.Process(os.getppid())
        _family[:] = [parent.pid] + [
            p.pid for p in parent.children(recursive=True) if p.pid != os.getpid()
        ]
    return _family


def downloaded_bytes(stats: str) -> dict[int, int]:
    """Bytes downloaded per client pid, from a `start(..., stats=)` file."""
    totals: dict[int, int] = {}
    if os.path.exists(stats):
        for line in open(stats):
            pid, nbytes = line.split()
            totals[int(pid)] = totals.get(int(pid), 0) + int(nbytes)
    return totals


objects.download = _download_with_generation  # before `server` builds its route table


def start(bucket: str, stats: str | None = None) -> tuple[subprocess.Popen, str]:
    """Starts the emulator with `bucket` created; returns (process, STORAGE_EMULATOR_HOST).
    With `stats`, downloads are counted per client process into that file."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.gcs_emulator", bucket, *([stats] if stats else [])],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        stdout=subprocess.PIPE,
        text=True,
    )
    port = process.stdout.readline().strip()
    if not port.isdigit():
        process.kill()
        raise RuntimeError("the GCS emulator did not start")
    return process, f"http://127.0.0.1:{port}"


def _serve(bucket: str) -> None:
    from gcp_storage_emulator.server import create_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket)
    server.start()
    print(port, flush=True)
    # Quiet from here on: the tests read only the port, and a full pipe would block the server.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    _STATS = sys.argv[2] if len(sys.argv) > 2 else None
    _serve(sys.argv[1])
