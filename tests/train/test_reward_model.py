"""Reward models (configs/rm.py): one head per domain, Bradley-Terry, usable as `rm:<path>`."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.config import load_config_file
from posttrain.data import load_tokenizer, preference_batches
from posttrain.demo import ASSETS_DIR, make_dataset
from posttrain.methods import run_from_config
from posttrain.models import get_preset
from posttrain.rewards import RewardPool, RewardRegistry, reward_scores
from posttrain.train import (
    ModelSpec,
    load_reward_model,
    read_metrics,
    reward_model_loss,
    reward_trainable,
)

from .conftest import REPO


def _pairs(records, domain):
    """Two domains that disagree: "plain" prefers the bare answer, "excited" the answer + "!"."""
    out = []
    for r in records:
        bare, loud = r["answer"], r["answer"] + "!"
        chosen, rejected = (bare, loud) if domain == "plain" else (loud, bare)
        out.append(
            {"prompt": r["prompt"], "chosen": chosen, "rejected": rejected, "domain": domain}
        )
    return out


@pytest.fixture(scope="module")
def held_out():
    return make_dataset(64, seed=1)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, held_out):
    """A tiny reward model trained from random init on both domains (30 steps)."""
    root = tmp_path_factory.mktemp("rm")
    train = make_dataset(256, seed=0, exclude=held_out)
    files = {
        "train": [*_pairs(train[:128], "plain"), *_pairs(train[128:], "excited")],
        "eval": [*_pairs(held_out[:32], "plain"), *_pairs(held_out[32:], "excited")],
    }
    for name, records in files.items():
        with open(root / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    config = load_config_file(os.path.join(REPO, "configs", "rm.py") + ":tiny")
    source = {"path": str(root / "train.jsonl"), "weight": 1.0, "domain": "plain", "format": "auto"}
    config.model.checkpoint = ""
    config.tokenizer = str(ASSETS_DIR / "tokenizer")
    config.data.sources = [source]
    config.eval_data = [{**source, "path": str(root / "eval.jsonl")}]
    config.data.max_len, config.data.batch_size = 32, 16
    config.optimizer.learning_rate, config.optimizer.warmup_steps = 1e-3, 0
    config.train.steps, config.train.log_every, config.train.progress = 30, 1, False
    config.train.eval_every = 0
    config.checkpoint.every = 30
    config.mesh.ici = {"data": -1, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 1}
    workdir = str(root / "run")
    summary = run_from_config(config, workdir)
    return workdir, summary


def test_each_head_learns_its_own_domain(trained):
    workdir, summary = trained
    assert summary["heads"] == ("plain", "excited")  # source domain first, then the others
    final = read_metrics(workdir, "eval")[-1]
    assert final["eval_pairs"] == 64
    assert final["eval_accuracy/plain"] >= 0.9, final
    assert final["eval_accuracy/excited"] >= 0.9, final
    first = read_metrics(workdir)[0]
    assert first["loss"] == pytest.approx(np.log(2), abs=0.2)  # small random heads: ~ chance


def test_saved_model_scores_with_the_right_head(trained, held_out):
    model = load_reward_model(trained[0])
    assert model.heads == ("plain", "excited")
    prompts = [r["prompt"] for r in held_out]
    bare = [r["answer"] for r in held_out]
    loud = [r["answer"] + "!" for r in held_out]
    for head, sign in (("plain", 1.0), ("excited", -1.0)):
        heads = [head] * len(prompts)
        margin = model.score(prompts, bare, heads) - model.score(prompts, loud, heads)
        assert np.mean(sign * margin > 0) >= 0.9, (head, margin)
    # A sequence's score does not depend on what it is batched with (padding, bucket sizes).
    alone = model.score(prompts[:1], bare[:1], ["plain"])
    batched = model.score(prompts[:5], [bare[0], *loud[1:5]], ["plain", *["excited"] * 4])
    np.testing.assert_allclose(batched[0], alone[0], atol=1e-5)
    with pytest.raises(ValueError, match="no head"):
        model.score(prompts[:1], bare[:1], ["math"])


def test_registry_and_pool_score_with_the_reward_model(trained, held_out):
    registry = RewardRegistry()
    registry.register("plain", f"rm:{trained[0]}")
    registry.register("arithmetic", "posttrain.rewards._arithmetic:arithmetic_reward")
    record = {**held_out[0], "domain": "plain"}
    bare, _ = registry.score(record, held_out[0]["answer"])
    loud, info = registry.score(record, held_out[0]["answer"] + "!")
    assert bare > loud and info["rm"]["head"] == "plain"
    records = [record, {**held_out[0], "domain": "arithmetic"}]
    completions = [held_out[0]["answer"], held_out[0]["answer"]]
    with RewardPool(registry, workers=1) as pool:
        results = pool.score(records, completions)
    assert results[0].score == pytest.approx(bare, abs=1e-5)
    assert results[1].score == 1.0  # the verifier, in a worker


def test_margins_shift_the_loss():
    """-log sigmoid(r_c - r_r - m) per pair, from the rewards the model gives each row."""
    config = get_preset("tiny", attention="xla")
    tok = load_tokenizer(str(ASSETS_DIR / "tokenizer"))
    records = _pairs(make_dataset(4, seed=0), "plain")
    for i, r in enumerate(records):
        r["margin"] = 0.5 * i
    batch = jax.tree.map(
        jnp.asarray, next(preference_batches(records, tok, max_len=32, batch_size=4, shuffle=False))
    )
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    params = reward_trainable(ModelSpec(), config, mesh, 0, 1).init()
    sums = reward_model_loss(config, domains=("plain",))(params, batch, None)
    r = {
        side: np.asarray(
            reward_scores(
                params,
                config,
                batch[f"{side}_tokens"],
                batch[f"{side}_positions"],
                batch[f"{side}_segment_ids"],
                batch["domain_ids"],
            )
        )
        for side in ("chosen", "rejected")
    }
    z = r["chosen"] - r["rejected"] - np.array([0.0, 0.5, 1.0, 1.5])
    expected = np.sum(np.log1p(np.exp(-z)))
    assert float(sums["loss_sum"]) == pytest.approx(expected, rel=1e-5)
    assert float(sums["num_tokens"]) == 4
