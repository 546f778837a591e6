"""The Gemma-style NNX example (configs/nnx.py) trained by the methods' own drivers: SFT loss
falls, LoRA on it trains only the adapters, DPO from the SFT checkpoint learns the pairs, and
GRPO's reward rises (seeded runs shrunk to seconds)."""

import json
import os

import jax
import numpy as np
import pytest

from posttrain.config import ConfigError, load_config_file, override
from posttrain.demo import ASSETS_DIR, make_dataset
from posttrain.methods import run_from_config
from posttrain.models import checkpoint_json
from posttrain.train import load_checkpoint_model, read_metrics
from tests.rl.toy import toy_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCE = {"path": str(ASSETS_DIR / "train.jsonl"), "weight": 1.0, "domain": "arithmetic",
          "format": "auto"}  # fmt: skip
SHORT = {
    "tokenizer": str(ASSETS_DIR / "tokenizer"),
    "data.sources": [SOURCE],
    "eval_data": [],
    "train.log_every": 1,
    "train.eval_every": 0,
    "train.progress": False,
    "checkpoint.async_save": False,
    "mesh.ici": {"data": -1, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 1},
}


def _nnx(preset: str, **values):
    config = load_config_file(os.path.join(REPO, "configs", f"nnx.py:{preset}"))
    return override(config, {**SHORT, **values})


def _losses(workdir) -> list[float]:
    return [r["loss"] for r in read_metrics(str(workdir))]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("nnx_sft")
    config = _nnx("sft", **{"train.steps": 30, "data.batch_size": 16, "data.max_len": 64,
                            "optimizer.warmup_steps": 5, "checkpoint.every": 30})  # fmt: skip
    run_from_config(config, str(workdir))
    return workdir


def test_sft_loss_falls_and_the_checkpoint_names_the_module(sft_run):
    losses = _losses(sft_run)
    assert len(losses) == 30 and np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.5, losses
    saved = checkpoint_json(str(sft_run))["model_config"]
    assert saved["nnx"]["builder"] == "posttrain.testing:nnx_decoder"
    assert json.loads(saved["nnx"]["kwargs"])["style"] == "gemma"


@pytest.mark.parametrize("quantize", ["", pytest.param("nf4", marks=pytest.mark.slow)])
def test_lora_on_the_module_trains_only_its_adapters(sft_run, tmp_path, quantize):
    """LoRA, and QLoRA (an nf4 base of the module's layer matrices: those without a vocab
    axis), on the module: only the adapted weights move."""
    config = _nnx("sft", **{"model.checkpoint": str(sft_run), "lora.enabled": True,
                            "lora.quantize": quantize, "lora.quant_block": 16, "lora.rank": 4,
                            "train.steps": 8, "data.batch_size": 16, "data.max_len": 64,
                            "optimizer.learning_rate": 1e-2, "optimizer.warmup_steps": 0,
                            "checkpoint.every": 8})  # fmt: skip
    run_from_config(config, str(tmp_path))
    losses = _losses(tmp_path)
    assert losses[-1] < losses[0], losses
    saved = checkpoint_json(str(tmp_path))
    assert "lora" in saved  # the checkpoint holds adapters and a pointer to the base
    base = load_checkpoint_model(str(sft_run)).params
    merged = load_checkpoint_model(str(tmp_path)).params
    adapted = 0
    for path, before in jax.tree_util.tree_leaves_with_path(base):
        name = jax.tree_util.keystr(path)
        after = merged
        for k in path:
            after = after[k.key]
        targeted = any(f"['{k}']" in name for k in ("q", "k", "v", "o", "gate", "up", "down"))
        if targeted:  # (QLoRA: the merged weight is the dequantised base plus the delta)
            adapted += not np.allclose(np.asarray(after), np.asarray(before), atol=1e-6)
        else:  # embeddings and norms: the frozen base, bit for bit
            np.testing.assert_array_equal(np.asarray(after), np.asarray(before), err_msg=name)
    assert adapted == 7 * 2  # every attention and MLP weight of both layers moved


def _pairs(records):
    """Demo problems as pairs: the right answer, and a wrong one with a digit appended."""
    return [{"prompt": r["prompt"], "chosen": r["answer"], "rejected": r["answer"] + "1",
             "domain": "arithmetic"} for r in records]  # fmt: skip


def test_dpo_from_the_sft_checkpoint_learns_the_pairs(sft_run, tmp_path):
    held_out = make_dataset(32, seed=1)
    files = {"train": _pairs(make_dataset(128, seed=0, exclude=held_out)), "eval": _pairs(held_out)}
    for name, records in files.items():
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    pairs = {**SOURCE, "path": str(tmp_path / "train.jsonl")}
    config = _nnx("dpo", **{"model.checkpoint": str(sft_run), "data.sources": [pairs],
                            "eval_data": [{**pairs, "path": str(tmp_path / "eval.jsonl")}],
                            "data.max_len": 32, "data.batch_size": 16, "loss.sft_weight": 0.0,
                            "optimizer.learning_rate": 1e-3, "optimizer.warmup_steps": 0,
                            "train.steps": 10, "checkpoint.every": 10})  # fmt: skip
    run_from_config(config, str(tmp_path / "run"))
    train = read_metrics(str(tmp_path / "run"))
    assert train[0]["loss"] == pytest.approx(np.log(2), abs=1e-5)  # policy == reference
    final = read_metrics(str(tmp_path / "run"), "eval")[-1]
    assert final["eval_accuracy"] >= 0.9 and final["eval_loss"] < np.log(2), final


def test_a_checkpoint_of_another_module_is_refused(sft_run, tmp_path):
    config = _nnx("dpo", **{"model.checkpoint": str(sft_run)})
    config.model.nnx_kwargs.num_layers = 3
    with pytest.raises(ConfigError, match="not model.nnx='posttrain.testing:nnx_decoder'"):
        run_from_config(config, str(tmp_path / "run"))
    assert not (tmp_path / "run" / "checkpoints").exists()


# Slow (~30 s): what it meets is met in the default suite apart: the engine decodes an NNX
# module as posttrain's own Llama (tests/models/test_nnx.py), GRPO's loss and gradients through
# one equal its (same file), and GRPO raises the toy reward (tests/rl/test_grpo.py).
@pytest.mark.slow
def test_grpo_reward_rises_on_the_toy_task(tmp_path):
    """GRPO (rollouts on the engine) from the module's random init, with the toy digit reward."""
    nnx = load_config_file(os.path.join(REPO, "configs", "nnx.py:grpo"))
    config = toy_config("tiny", train__steps=12, optimizer__learning_rate=1e-2)
    override(config, {"model.nnx": nnx.model.nnx, "model.nnx_kwargs": nnx.model.nnx_kwargs,
                      "model.remat": ""})  # fmt: skip
    run_from_config(config, str(tmp_path))
    rewards = [r["reward"] for r in read_metrics(str(tmp_path))]
    first, last = np.mean(rewards[:4]), np.mean(rewards[-4:])
    assert last > first + 0.2, rewards
