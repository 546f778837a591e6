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


def test_corrupt_latest_falls_back_to_previous(tmp_path, devices, caplog):
    mesh = make_mesh(MeshConfig.from_dict({"fsdp": 8}))
    first, second = _state(mesh, seed=0), _state(mesh, seed=1)
    checkpointer = Checkpointer(str(tmp_path), CheckpointConfig(async_save=False))
    checkpointer.save(1, first)
    checkpointer.save(2, second)
    checkpointer.close()
    _corrupt(tmp_path / "checkpoints" / "2")
    target, _ = _abstract(mesh)
    with caplog.at_level("WARNING"):
        step, restored, _, _ = Checkpointer(str(tmp_path), CheckpointConfig()).restore(target)
    assert step == 1
    assert "checkpoint 2" in caplog.text and "trying the previous one" in caplog.text
    _assert_equal(restored.params, first.params)
    assert os.path.isdir(tmp_path / "checkpoints" / "2")  # nothing deleted

    _corrupt(tmp_path / "checkpoints" / "1")
    with pytest.raises(RuntimeError, match="no readable checkpoint"):
        Checkpointer(str(tmp_path), CheckpointConfig()).restore(target)


def test_keep_last_and_keep_best(tmp_path, devices):
    mesh = make_mesh(MeshConfig.from_dict({"fsdp": 8}))
    state = _state(mesh)
    checkpointer = Checkpointer(
        str(tmp_path), CheckpointConfig(keep_last=2, keep_best=1, async_save=False)
    )
    for step, loss in [(1, 3.0), (2, 1.0), (3, 2.0), (4, 2.5), (5, 2.7)]:
        checkpointer.save(step, state, metrics={"eval_loss": loss})
    checkpointer.close()
    assert sorted(int(s) for s in os.listdir(tmp_path / "checkpoints") if s.isdigit()) == [2, 4, 5]
