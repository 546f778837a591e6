"""The SFT driver end to end: train, export to HF, presets shape-checked."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain import cli
from posttrain.config import build, load_config_file
from posttrain.methods import SFTConfig, run_from_config
from posttrain.testing import hf_logits
from posttrain.train import (
    create_state,
    load_checkpoint_model,
    make_optimizer,
    read_metrics,
    sft_loss,
    train_step,
)
from tests.train.conftest import REPO, small_config


@pytest.fixture(scope="module")
def trained(tmp_path_factory, devices):
    workdir = tmp_path_factory.mktemp("sft")
    config = small_config(**{"train__steps": 30, "optimizer__warmup_steps": 5})
    config.eval_data = load_config_file(os.path.join(REPO, "configs", "sft.py") + ":tiny").eval_data
    config.train.eval_every = 15
    summary = run_from_config(config, str(workdir))
    return workdir, summary


def test_training_lowers_the_loss_and_logs_everything(trained):
    workdir, summary = trained
    train = read_metrics(str(workdir), "train")
    assert [r["step"] for r in train] == list(range(1, 31))
    assert train[-1]["loss"] < 0.6 * train[0]["loss"]
    evals = read_metrics(str(workdir), "eval")
    assert [r["step"] for r in evals] == [15, 30] and evals[1]["eval_loss"] < evals[0]["eval_loss"]
    assert os.listdir(workdir / "tensorboard")  # event files
    manifest = (workdir / "manifest.json").read_text()
    assert "sha256" in manifest and "train.jsonl" in manifest
    assert summary["stopped"] == "completed" and summary["data"]["used"] > 0
    counts = {k: summary["data"][k] for k in ("truncated", "dropped", "skipped", "no_loss")}
    assert {k: train[-1][f"data/{k}"] for k in counts} == counts  # the records' accounting


def test_export_writes_an_hf_model_with_the_same_logits(trained, tmp_path):
    workdir, _ = trained
    out = tmp_path / "hf"
    assert cli.main(["export", f"--workdir={workdir}", f"--out={out}"]) == 0
    model = load_checkpoint_model(str(workdir))
    tokens = np.random.RandomState(0).randint(0, 512, (2, 20)).astype(np.int32)
    ours = np.asarray(model(jnp.asarray(tokens)))
    np.testing.assert_allclose(hf_logits(str(out), tokens), ours, atol=1e-4)


@pytest.mark.parametrize(
    "preset", ["llama3_8b_v5p", pytest.param("qwen3_32b_v5p", marks=pytest.mark.slow)]
)
def test_real_size_presets_shape_check(preset):
    """The full train step traces at the preset's real shapes (no weights allocated)."""
    values = load_config_file(os.path.join(REPO, "configs", "sft.py") + f":{preset}")
    config = build(SFTConfig, {k: v for k, v in values.items() if k != "method"})
    model_config = config.model.model_config()
    # (the remat policy `posttrain compile --remat-sweep` found fastest on the plan's slice)
    assert model_config.remat == "dots_no_batch" and model_config.compute_dtype == "bfloat16"
    optimizer = make_optimizer(config.optimizer, config.train.steps)
    from posttrain.models import param_shapes

    state = jax.eval_shape(
        functools.partial(create_state, optimizer=optimizer, seed=0), param_shapes(model_config)
    )
    rows, length = config.data.batch_size, config.data.max_len
    batch = {
        k: jax.ShapeDtypeStruct((rows, length), jnp.float32 if k == "loss_mask" else jnp.int32)
        for k in ("tokens", "targets", "loss_mask", "positions", "segment_ids")
    }
    step = functools.partial(
        train_step,
        loss_fn=sft_loss(model_config, 0.0),
        optimizer=optimizer,
        micro_batches=config.train.micro_batches,
    )
    new_state, metrics = jax.eval_shape(step, state, batch)
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    assert metrics["loss"].shape == ()
