"""LoRA SFT end to end: learns the demo task on a frozen base, adapters-only state and
checkpoints, exact resume, merged and PEFT export."""

import dataclasses
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain import cli
from posttrain.config import build, load_config_file, to_plain
from posttrain.data import load_tokenizer, make_pipeline
from posttrain.lora import adapter_kwargs, adapter_shapes
from posttrain.methods import SFTConfig, run_from_config
from posttrain.models import checkpoint_json, forward, init_params
from posttrain.parallel import make_mesh
from posttrain.testing import hf_logits
from posttrain.train import (
    load_checkpoint_model,
    load_lora_params,
    read_metrics,
    sft_loss,
)
from posttrain.train._run import summed
from tests.train.conftest import REPO, small_config

LORA = {"lora__enabled": True, "lora__rank": 8, "optimizer__learning_rate": 1e-2}


def _eval_accuracy(config, params, model_config):
    """Token accuracy of `params` (no adapters) on the demo's eval split (first 4 batches)."""
    values = dict(to_plain(config))
    values.pop("method")
    c = build(SFTConfig, values)
    data = dataclasses.replace(c.data, sources=c.eval_data, shuffle=False, num_epochs=1)
    loss = sft_loss(model_config, 0.0)
    step = jax.jit(lambda p, b: loss(p, b, None))
    mesh = make_mesh(c.mesh, jax.devices())
    totals = summed(step, params, make_pipeline(data, load_tokenizer(c.tokenizer)), mesh, 4)
    return totals["accuracy_sum"] / totals["num_tokens"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, devices):
    workdir = str(tmp_path_factory.mktemp("lora_sft"))
    config = small_config(
        **LORA,
        train__steps=200,
        train__eval_every=100,
        train__eval_batches=4,
        checkpoint__every=100,
        optimizer__warmup_steps=10,
        data__max_len=128,
        data__batch_size=16,
    )
    config.eval_data = load_config_file(os.path.join(REPO, "configs", "sft.py") + ":tiny").eval_data
    summary = run_from_config(config, workdir)
    return config, workdir, summary


def test_lora_learns_the_demo_task_on_a_frozen_base(run):
    config, workdir, summary = run
    model_config = summary["model_config"]
    base = summary["base_params"]
    # The frozen base is bitwise what the run started from (random init with train.seed).
    fresh = init_params(model_config, jax.random.key(config.train.seed))
    for x, y in zip(jax.tree.leaves(base), jax.tree.leaves(fresh), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    base_accuracy = _eval_accuracy(config, base, model_config)
    evals = read_metrics(workdir, "eval")
    assert evals[-1]["eval_accuracy"] > base_accuracy + 0.25, (base_accuracy, evals)


def test_only_adapters_are_trained_and_checkpointed(run):
    config, workdir, summary = run
    state = summary["state"]
    shapes = adapter_shapes(summary["model_config"], load_lora_params(workdir, merged=False)[2])
    assert jax.tree.structure(state.params) == jax.tree.structure(shapes)
    wanted = {s.shape for s in jax.tree.leaves(shapes)}
    moments = [x for x in jax.tree.leaves(state.opt_state) if np.ndim(x) > 0]
    assert moments and {x.shape for x in moments} <= wanted
    n_adapter = sum(x.size for x in jax.tree.leaves(state.params))
    n_base = sum(x.size for x in jax.tree.leaves(summary["base_params"]))
    assert sum(x.size for x in moments) == 2 * n_adapter < n_base
    saved = checkpoint_json(workdir)
    assert saved["lora"]["base"]["preset"] == "tiny" and saved["lora"]["seed"] == 0


def test_checkpoint_loads_as_the_merged_model(run):
    config, workdir, summary = run
    model = load_checkpoint_model(workdir)
    base, adapters, lora = load_lora_params(workdir, merged=False)
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 512, (2, 16)), jnp.int32)
    wrapped = forward(base, tokens, model.config, **adapter_kwargs(lora, adapters))
    np.testing.assert_allclose(np.asarray(model(tokens)), np.asarray(wrapped), atol=1e-5)


def test_export_merged_and_peft(run, tmp_path):
    _, workdir, _ = run
    merged = tmp_path / "merged"
    assert cli.main(["export", f"--workdir={workdir}", f"--out={merged}"]) == 0
    model = load_checkpoint_model(workdir)
    tokens = np.random.RandomState(1).randint(0, 512, (2, 20)).astype(np.int32)
    ours = np.asarray(model(jnp.asarray(tokens)))
    np.testing.assert_allclose(hf_logits(str(merged), tokens), ours, atol=1e-4)
    peft = tmp_path / "peft"
    assert cli.main(["export", f"--workdir={workdir}", f"--out={peft}", "--nomerge-lora"]) == 0
    assert sorted(os.listdir(peft)) == ["adapter_config.json", "adapter_model.safetensors"]


# Exact resume of the shared loop: tests/train/test_resume.py (default); this is its LoRA run.
@pytest.mark.slow  # ~55 s
def test_resume_equals_an_uninterrupted_run(tmp_path, devices):
    overrides = dict(LORA, train__steps=8, checkpoint__every=4)
    straight = run_from_config(small_config(**overrides), str(tmp_path / "straight"))
    # The same run stopped after its step-4 checkpoint: drop the later one and resume.
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "8")
    steps = []
    resumed = run_from_config(
        small_config(**overrides),
        str(tmp_path / "resumed"),
        on_metrics=lambda step, metrics: steps.append(step),
    )
    assert steps == [5, 6, 7, 8] and int(resumed["state"].step) == 8
    for x, y in zip(
        jax.tree.leaves(straight["state"].params), jax.tree.leaves(resumed["state"].params),
        strict=True,
    ):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
