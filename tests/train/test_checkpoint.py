"""Checkpoints: resharding restore, fallback past a corrupt checkpoint, keep-last plus keep-best."""

import functools
import os

import jax
import numpy as np
import pytest

from posttrain.models import get_preset, init_params, param_shapes, param_shardings
from posttrain.parallel import MeshConfig, make_mesh
from posttrain.train import (
    CheckpointConfig,
    Checkpointer,
    NonFiniteStateError,
    OptimizerConfig,
    create_state,
    make_optimizer,
    state_shardings,
)

CONFIG = get_preset("tiny", attention="xla")
OPTIMIZER = make_optimizer(OptimizerConfig(), 10)


def _abstract(mesh):
    abstract = jax.eval_shape(
        functools.partial(create_state, optimizer=OPTIMIZER, seed=0), param_shapes(CONFIG)
    )
    shardings = state_shardings(OPTIMIZER, abstract, param_shardings(CONFIG, mesh), mesh)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings
    ), shardings


def _state(mesh, seed=0):
    _, shardings = _abstract(mesh)
    params = init_params(CONFIG, jax.random.key(seed), mesh)
    return jax.jit(
        functools.partial(create_state, optimizer=OPTIMIZER, seed=seed), out_shardings=shardings
    )(params)


def _assert_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_restore_onto_a_different_mesh(tmp_path, devices):
    save_mesh = make_mesh(MeshConfig.from_dict({"fsdp": 8}))
    state = _state(save_mesh)
    checkpointer = Checkpointer(str(tmp_path), CheckpointConfig())
    checkpointer.save(1, state, data_state={"position": 3}, extra={"config": {"a": 1}})
    checkpointer.close()

    load_mesh = make_mesh(MeshConfig.from_dict({"data": 2, "tensor": 4}))
    target, _ = _abstract(load_mesh)
    step, restored, data_state, extra = Checkpointer(str(tmp_path), CheckpointConfig()).restore(
        target
    )
    assert step == 1 and data_state == {"position": 3} and extra["config"] == {"a": 1}
    _assert_equal(restored.params, state.params)
    _assert_equal(restored.opt_state, state.opt_state)
    q = restored.params["layers"]["attn"]["q"]  # [T, D, N, H]: heads over tensor=4, D unsharded
    assert q.sharding.mesh.shape == load_mesh.shape
    assert q.addressable_shards[0].data.shape == (2, 64, 2, 16)


def _corrupt(step_dir):
    """Truncates every array data file of a checkpoint, as a crash mid-write might."""
    hits = 0
    for root, _, files in os.walk(step_dir):
        for name in files:
            path = os.path.join(root, name)
            if "state" in root and os.path.getsize(path) > 1000:
                with open(path, "r+b") as f:
                    f.truncate(100)
                hits += 1
    assert hits


def _corrupt_json(step_dir):
    """Cuts the JSON item saved with the checkpoint (the run config) in half."""
    path = step_dir / "config" / "metadata"
    path.write_text(path.read_text()[: len(path.read_text()) // 2])


def _corrupt_metadata(step_dir):
    """Garbles Orbax's description of the arrays (the state item's _METADATA)."""
    (step_dir / "state" / "_METADATA").write_text("{not json")


def _small(seed: float) -> dict:
    """A state big enough for array data files (> 1000 bytes), quick to save and restore."""
    return {"w": jax.numpy.arange(4096.0) + seed, "b": jax.numpy.full(3, seed)}


SMALL = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _small(0.0))


@pytest.mark.parametrize("corrupt", [_corrupt, _corrupt_json, _corrupt_metadata])
def test_unreadable_latest_is_moved_aside_and_the_previous_restored(corrupt, tmp_path, caplog):
    checkpointer = Checkpointer(str(tmp_path), CheckpointConfig(async_save=False))
    checkpointer.save(1, _small(1.0), extra={"config": {"a": 1}})
    checkpointer.save(2, _small(2.0), extra={"config": {"a": 2}})
    checkpointer.close()
    corrupt(tmp_path / "checkpoints" / "2")
    checkpointer = Checkpointer(str(tmp_path), CheckpointConfig(keep_last=1, async_save=False))
    with caplog.at_level("WARNING"):
        step, restored, _, extra = checkpointer.restore(SMALL)
    assert step == 1 and extra["config"] == {"a": 1}
    assert "checkpoint 2" in caplog.text and "2.corrupt" in caplog.text
    _assert_equal(restored, _small(1.0))
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2.corrupt"]  # kept, aside
    # The run goes on and saves step 2 again; keep_last=1 then drops step 1, not the new 2.
    checkpointer.save(2, restored)
    checkpointer.close()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "2.corrupt"]
    step, again, _, _ = Checkpointer(str(tmp_path), CheckpointConfig()).restore(SMALL)
    assert step == 2
    _assert_equal(again, _small(1.0))


def test_when_none_restores_nothing_is_moved_and_the_error_names_each(tmp_path):
    checkpointer = Checkpointer(str(tmp_path), CheckpointConfig(async_save=False))
    checkpointer.save(1, _small(1.0))
    checkpointer.save(2, _small(2.0))
    checkpointer.close()
    _corrupt(tmp_path / "checkpoints" / "2")
    other = {"w": jax.ShapeDtypeStruct((8,), np.float32), "b": SMALL["b"]}  # e.g. a new rank
    with pytest.raises(RuntimeError, match="left in place(.|\n)*step 2: (.|\n)*step 1: "):
        Checkpointer(str(tmp_path), CheckpointConfig()).restore(other)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2"]


def test_a_state_with_a_nan_is_never_saved(tmp_path):
    state = _small(1.0)
    state["w"] = state["w"].at[3].set(np.nan)
    checkpointer = Checkpointer(str(tmp_path), CheckpointConfig(async_save=False))
    with pytest.raises(NonFiniteStateError, match="refusing to save step 7"):
        checkpointer.save(7, state)
    checkpointer.close()
    assert checkpointer.latest_step() is None


def test_an_unreadable_checkpoint_in_a_bucket_is_moved_aside(gcs_bucket):
    from google.cloud import storage

    from posttrain import paths

    url = f"{gcs_bucket}/quarantine"
    checkpointer = Checkpointer(url, CheckpointConfig(async_save=False))
    checkpointer.save(1, _small(1.0), extra={"config": {"a": 1}})
    checkpointer.save(2, _small(2.0), extra={"config": {"a": 2}})
    checkpointer.close()
    paths.write_text(f"{url}/checkpoints/2/config/metadata", '{"a": ')
    checkpointer = Checkpointer(url, CheckpointConfig(async_save=False))
    step, restored, _, extra = checkpointer.restore(SMALL)
    assert step == 1 and extra["config"] == {"a": 1}
    _assert_equal(restored, _small(1.0))
    assert checkpointer.save(2, restored)  # Orbax's view of the bucket forgot the old step 2
    checkpointer.close()
    bucket = gcs_bucket.removeprefix("gs://")
    blobs = storage.Client().list_blobs(bucket, prefix="quarantine/checkpoints/")
    assert {b.name.split("/")[2] for b in blobs} == {"1", "2", "2.corrupt"}


def test_keep_last_and_keep_best(tmp_path):
    state = _small(1.0)
    checkpointer = Checkpointer(
        str(tmp_path), CheckpointConfig(keep_last=2, keep_best=1, async_save=False)
    )
    for step, loss in [(1, 3.0), (2, 1.0), (3, 2.0), (4, 2.5), (5, 2.7)]:
        checkpointer.save(step, state, metrics={"eval_loss": loss})
    checkpointer.close()
    assert sorted(int(s) for s in os.listdir(tmp_path / "checkpoints") if s.isdigit()) == [2, 4, 5]


def test_keep_last_zero_keeps_every_checkpoint(tmp_path):
    state = _small(1.0)
    checkpointer = Checkpointer(
        str(tmp_path), CheckpointConfig(keep_last=0, keep_best=0, async_save=False)
    )
    for step in range(1, 5):
        checkpointer.save(step, state)
    checkpointer.close()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2", "3", "4"]
