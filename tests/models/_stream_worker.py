"""One of the processes of tests/models/test_hf_stream.py: loads an HF checkpoint from gs:// onto
an fsdp mesh over every process's devices, then exports it to gs:// and to a local folder.

`python -m tests.models._stream_worker LOCAL_MODEL OUT` with STORAGE_EMULATOR_HOST, BUCKET and
POSTTRAIN_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID set. Process 0 uploads LOCAL_MODEL first;
each process writes OUT/stats-<i>.json; process 0 also writes OUT/params.npz (the loaded params,
gathered) and downloads the gs:// export to OUT/gs_export.
"""

import json
import os
import sys

from posttrain.parallel import initialize

if __name__ == "__main__":
    initialize()

    import time

    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from posttrain import paths
    from posttrain.models import _hf_export, from_hf, to_hf
    from posttrain.models._safetensors import STATS
    from posttrain.parallel import MeshConfig, make_mesh

    t0 = time.time()

    def mark(what):
        print(f"[{jax.process_index()}] {what}: {time.time() - t0:.1f}s", flush=True)

    local, out = sys.argv[1], sys.argv[2]
    bucket = os.environ["BUCKET"]
    if jax.process_index() == 0:
        paths.upload(local, f"{bucket}/model")
    multihost_utils.sync_global_devices("uploaded")

    STATS.reset()
    mesh = make_mesh(MeshConfig.from_dict({"fsdp": 8}))
    model = from_hf(f"{bucket}/model", mesh=mesh, attention="xla")
    mark("loaded")
    multihost_utils.sync_global_devices("loaded")
    if jax.process_index() == 0 and os.environ.get("DOWNLOADS"):  # the emulator's count so far
        with open(os.environ["DOWNLOADS"]) as f:
            downloads = f.read()
        with open(os.path.join(out, "downloads-load.txt"), "w") as f:
            f.write(downloads)
    stats = {
        "pid": os.getpid(),
        "tensor_bytes": STATS.tensor_bytes,
        "header_bytes": STATS.header_bytes,
        "requests": STATS.requests,
        "devices": [d.id for d in jax.local_devices()],
    }
    with open(os.path.join(out, f"stats-{jax.process_index()}.json"), "w") as f:
        json.dump(stats, f)

    params = {
        "/".join(str(getattr(k, "key", k)) for k in path): np.asarray(
            multihost_utils.process_allgather(leaf, tiled=True)
        )
        for path, leaf in jax.tree_util.tree_leaves_with_path(model.params)
    }
    if jax.process_index() == 0:
        np.savez(os.path.join(out, "params.npz"), **params)

    mark("gathered")
    _hf_export._COMPOSE_LIMIT = 4  # one file from ~25 parts: composed in several steps
    to_hf(model, f"{bucket}/export")
    mark("exported to gs://")
    to_hf(model, os.path.join(out, "local_export"), max_shard_bytes=40_000)  # shards + index
    mark("exported locally")
    if jax.process_index() == 0:
        fs = _hf_export.filesystem(bucket)
        fs.get(f"{bucket}/export/", os.path.join(out, "gs_export") + "/", recursive=True)
    multihost_utils.sync_global_devices("done")
    mark("done")
