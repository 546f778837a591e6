"""A GCS emulator for tests: gcp-storage-emulator in memory, in its own process, on a free port.

`python -m tests.gcs_emulator BUCKET` prints the port once it serves. Tests reach it only through
`STORAGE_EMULATOR_HOST`, as a user would reach any emulator or GCS itself.

The emulator leaves out the `x-goog-generation` header of object downloads, which GCS sends and
tensorstore (Orbax's array writer) needs for its conditional writes; it is added here, so the
emulator answers as GCS does.
"""

import os
import socket
import subprocess
import sys
import time

from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

_download = objects.download


def _download_with_generation(request, response, storage, *args, **kwargs):
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        response["x-goog-generation"] = obj["generation"]
        response["x-goog-metageneration"] = obj["metageneration"]
    except NotFound:
        pass  # no such object: the emulator's own download answers 404
    return _download(request, response, storage, *args, **kwargs)


objects.download = _download_with_generation  # before `server` builds its route table


def start(bucket: str) -> tuple[subprocess.Popen, str]:
    """Starts the emulator with `bucket` created; returns (process, STORAGE_EMULATOR_HOST)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.gcs_emulator", bucket],
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
    _serve(sys.argv[1])
