"""The shared loop: divergence stop with a checkpoint; config errors before anything compiles."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.config import ConfigError, build
from posttrain.methods import SFTConfig, run_from_config
from posttrain.models import get_preset, init_params
from posttrain.parallel import MeshConfig, make_mesh
from posttrain.train import (
    CheckpointConfig,
    Checkpointer,
    LoopConfig,
    OptimizerConfig,
    TrainingDiverged,
    create_state,
    make_optimizer,
    read_metrics,
    train_loop,
    train_step,
)
from tests.train.conftest import small_config

CONFIG = get_preset("tiny", attention="xla")


class _Batches:
    def __init__(self):
        self.position = 0

    def __iter__(self):
        return self

    def __next__(self):
        """Batches 1 and 2 are fine; from batch 3 on, token 0 marks them as poisoned."""
        self.position += 1
        ones = np.ones((8, 16), np.int32)
        tokens = ones * (1 if self.position <= 2 else 0)
        return {
            "tokens": tokens,
            "targets": ones,
            "loss_mask": ones.astype(np.float32),
            "positions": np.tile(np.arange(16, dtype=np.int32), (8, 1)),
            "segment_ids": ones,
        }

    def get_state(self):
        return {"position": self.position}


def test_divergence_stops_with_a_checkpoint(tmp_path, devices):
    mesh = make_mesh(MeshConfig.from_dict({"data": 8}))
    optimizer = make_optimizer(OptimizerConfig(), 10)
    state = create_state(init_params(CONFIG, jax.random.key(0)), optimizer, seed=0)

    def nan_loss(params, batch, rng):  # NaN on poisoned batches
        loss = jnp.sum(params["final_norm"] ** 2)
        return {"loss_sum": jnp.where(batch["tokens"][0, 0] > 0, loss, jnp.nan), "num_tokens": 1.0}

    step_fn = jax.jit(functools.partial(train_step, loss_fn=nan_loss, optimizer=optimizer))
    checkpointer = Checkpointer(str(tmp_path), CheckpointConfig(every=100))
    with pytest.raises(TrainingDiverged, match="3 consecutive steps.*checkpoint was saved"):
        with jax.set_mesh(mesh):
            train_loop(
                state=state,
                step_fn=step_fn,
                data=_Batches(),
                mesh=mesh,
                workdir=str(tmp_path),
                loop=LoopConfig(steps=50, max_bad_steps=3, log_every=1, progress=False),
                checkpointer=checkpointer,
            )
    saved = [int(s) for s in os.listdir(tmp_path / "checkpoints") if s.isdigit()]
    assert saved == [6]  # bad steps 3, 4, 5 seen one step late, stopped after dispatching 6
    bad = [r["bad_step"] for r in read_metrics(str(tmp_path))]
    assert bad == [0, 0, 1, 1, 1]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"data__bogus": 1}, r"data has unknown key\(s\) \['bogus'\]"),
        ({"mesh__ici__data": 3}, r"mesh.ici \(data=3\) multiplies to 3, but there are 8 devices"),
        ({"data__batch_size": 12}, r"not divisible by the data-parallel size 8"),
        ({"optimizer__schedule": "cosin"}, r"optimizer.schedule='cosin'"),
        ({"train__profile_steps": "5-7"}, r"train.profile_steps='5-7': write FIRST:LAST"),
    ],
)
def test_bad_config_is_one_clear_error(tmp_path, change, message, devices):
    config = small_config()
    for key, value in change.items():
        node = config
        *parents, leaf = key.split("__")
        for name in parents:
            node = node[name]
        node[leaf] = value  # load_config_file leaves the config unlocked
    with pytest.raises((ConfigError, ValueError), match=message):
        run_from_config(config, str(tmp_path))
    assert not os.path.exists(tmp_path / "checkpoints")  # failed before any work


def test_missing_data_file_fails_before_compiling(tmp_path, devices):
    config = small_config()
    config.data.sources[0].path = str(tmp_path / "nope.jsonl")
    with pytest.raises(Exception, match="nope.jsonl"):
        run_from_config(config, str(tmp_path))
    assert not os.path.exists(tmp_path / "checkpoints")


def test_config_round_trips_through_json():
    import dataclasses
    import json

    config = build(SFTConfig, {k: v for k, v in small_config().items() if k != "method"})
    again = build(SFTConfig, json.loads(json.dumps(dataclasses.asdict(config))))
    assert again == config
