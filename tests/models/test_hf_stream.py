"""HF checkpoints read by byte ranges (local or gs://) and written by every process: 2 processes x
4 fake CPU devices load a tiny Llama from a GCS emulator onto an fsdp=8 mesh, each reading about
half of the tensor bytes (counted by the reader and, independently, by the emulator per client
process), and export it to gs:// and to a shared local folder byte for byte as one process does.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from posttrain.models import from_hf, to_hf
from posttrain.models._safetensors import STATS, Region, _merge, _runs
from posttrain.parallel import MeshConfig, make_mesh
from posttrain.testing import hf_logits, save_tiny_hf_model
from tests import gcs_emulator
from tests.launch import launch_group
from tests.tolerance import assert_close

SHARE = 0.5 + 0.1  # what one of 2 processes may read of the tensor bytes


def _tensor_bytes(path: str) -> int:
    """The tensor bytes of an HF directory's safetensors files (read by the safetensors package)."""
    total = 0
    for file in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
        with safe_open(os.path.join(path, file), framework="numpy") as f:
            total += sum(f.get_tensor(name).nbytes for name in f.keys())
    return total


# Fewer rows than the other tests' tiny models: each process reads half of each row of most
# weights (fsdp shards their input dim), one byte range per row, and the emulator is slow per
# request (~5-15 ms).
SMALL = dict(vocab_size=64, num_hidden_layers=1, intermediate_size=32, num_attention_heads=4)
SMALL.update(num_key_value_heads=2)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("stream") / "model")
    return save_tiny_hf_model("llama3", path, **SMALL)


@pytest.fixture(scope="module")
def two_processes(hf_dir, tmp_path_factory):
    """Runs the 2 workers (tests/models/_stream_worker.py) against an emulator of their own that
    counts each process's downloads; returns their output folder and the emulator's counts."""
    out = tmp_path_factory.mktemp("workers")
    downloads = str(out / "downloads.txt")
    emulator, host = gcs_emulator.start("stream-test", stats=downloads)
    env = dict(  # the workers reach our emulator (posttrain.paths points tensorstore at it)
        STORAGE_EMULATOR_HOST=host,
        BUCKET="gs://stream-test",
        POSTTRAIN_CACHE=str(out / "cache"),
        DOWNLOADS=downloads,
    )
    argv = ["-m", "tests.models._stream_worker", hf_dir, str(out)]
    workers = launch_group(argv, processes=2, devices=4, env=env)
    try:
        for i, w in enumerate(workers):
            log, _ = w.communicate(timeout=300)
            (out / f"worker-{i}.log").write_text(log)
            assert w.returncode == 0, log[-4000:]
    finally:
        for w in workers:
            w.kill()
        emulator.kill()
        emulator.wait()
    return out, gcs_emulator.downloaded_bytes(str(out / "downloads-load.txt"))


def test_each_process_reads_its_half_and_loads_what_one_process_loads(hf_dir, two_processes):
    out, downloads = two_processes
    total = _tensor_bytes(hf_dir)
    stats = [json.load(open(out / f"stats-{i}.json")) for i in range(2)]
    for s in stats:  # the reader's own count of the tensor bytes it requested
        assert s["tensor_bytes"] <= SHARE * total, (s, total)
    assert sum(s["tensor_bytes"] for s in stats) >= total  # every byte read by someone
    file_bytes = sum(
        os.path.getsize(os.path.join(hf_dir, f)) for f in os.listdir(hf_dir) if "." in f
    )
    for s in stats:  # what the emulator served each process (headers and config.json included)
        served = downloads.get(s["pid"], 0)
        assert s["tensor_bytes"] <= served <= SHARE * file_bytes, (served, file_bytes)
    ours = from_hf(hf_dir, attention="xla")
    loaded = np.load(out / "params.npz")
    flat = {
        "/".join(str(getattr(k, "key", k)) for k in path): leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(ours.params)
    }
    assert sorted(flat) == sorted(loaded.files)
    for name, leaf in flat.items():
        np.testing.assert_array_equal(loaded[name], np.asarray(leaf), err_msg=name)


def test_two_process_exports_are_what_one_process_writes(hf_dir, two_processes, tmp_path):
    out, _ = two_processes
    model = from_hf(hf_dir, attention="xla")
    to_hf(model, str(tmp_path / "one"))
    to_hf(model, str(tmp_path / "one_sharded"), max_shard_bytes=40_000)
    for two, one in [("gs_export", "one"), ("local_export", "one_sharded")]:
        names = sorted(os.listdir(tmp_path / one))
        assert sorted(os.listdir(out / two)) == names, two
        for name in names:
            a, b = (out / two / name).read_bytes(), (tmp_path / one / name).read_bytes()
            assert a == b, f"{two}/{name} differs from one process's export"
    assert len([n for n in os.listdir(out / "local_export") if n.endswith(".safetensors")]) > 1
    assert not [n for n in os.listdir(out) if ".export-" in n], "staging folder left behind"
    # transformers loads the 2-process gs:// export: the model's logits.
    rng = np.random.RandomState(0)
    tokens = rng.randint(1, 64, size=(2, 9)).astype(np.int32)
    mask = np.ones_like(tokens)
    logits = np.asarray(jax.jit(lambda m, t: m(t))(model, jnp.asarray(tokens)))
    exported = hf_logits(str(out / "gs_export"), tokens, mask)
    np.testing.assert_array_equal(exported, hf_logits(hf_dir, tokens, mask))  # same weights
    assert_close(exported, logits, rtol=1e-5)


def test_local_reads_only_each_shards_ranges(hf_dir, devices):
    """One process, fsdp=2 x tensor=4: everything is read once, within the gap slack; a mesh of
    one device reads each tensor once too."""
    total = _tensor_bytes(hf_dir)
    STATS.reset()
    mesh = make_mesh(MeshConfig.from_dict({"fsdp": 2, "tensor": 4}))
    from_hf(hf_dir, mesh=mesh)
    assert total <= STATS.tensor_bytes <= 1.05 * total
    STATS.reset()
    from_hf(hf_dir)
    assert STATS.tensor_bytes == total


def test_bfloat16_checkpoint_reads_onto_a_mesh(hf_dir, tmp_path, devices):
    model = from_hf(hf_dir, dtype=jnp.bfloat16)
    to_hf(model, str(tmp_path / "bf16"), max_shard_bytes=20_000)
    mesh = make_mesh(MeshConfig.from_dict({"fsdp": 2, "tensor": 4}))
    sharded = from_hf(str(tmp_path / "bf16"), dtype=jnp.bfloat16, mesh=mesh)
    for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(sharded.params), strict=True):
        assert b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_runs_and_merging():
    # A [4, 6] column block [1:3] of a row-major [4, 8] tensor: 4 runs of 2 elements.
    starts, run = _runs(Region("w", 1, (4, 2), (8, 1)))
    assert run == 2 and starts.tolist() == [1, 9, 17, 25]
    # Whole rows join into one run.
    starts, run = _runs(Region("w", 8, (2, 8), (8, 1)))
    assert run == 16 and starts.tolist() == [8]
    # Adjacent and overlapping runs merge; a gap within 5% of the bytes joins, a wide one not.
    merged = _merge([(np.array([0, 100, 150]), 100), (np.array([260, 10_000]), 100)])
    assert merged.tolist() == [[0, 360], [10_000, 10_100]]
