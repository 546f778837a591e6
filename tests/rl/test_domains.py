"""Several domains in one RL run: per-domain metrics, adaptive weights, difficulty filtering,
grouped domain updates, and the stability monitor."""

import json

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from posttrain.data import DataConfig, SourceConfig, load_tokenizer
from posttrain.demo import ASSETS_DIR
from posttrain.methods import run_from_config
from posttrain.rl._domains import StabilityMonitor, normalise_by_domain, update_scales
from posttrain.rl._prompts import PromptData
from posttrain.train import read_metrics
from posttrain.train._state import create_state
from posttrain.train._step import train_step

from .toy import LEARNABLE_REWARDS, TWO_DOMAIN_REWARDS, toy_config, two_domain_prompts


def _config(tmp_path, **overrides):
    source = {"path": two_domain_prompts(tmp_path / "prompts.jsonl"), "weight": 1.0,
              "domain": "digits", "format": "auto"}  # fmt: skip
    overrides = {"rewards__domains": TWO_DOMAIN_REWARDS, **overrides}
    return toy_config(data__sources=[source], **overrides)


def test_adaptive_weights_move_to_the_domain_with_signal(tmp_path):
    config = _config(tmp_path, train__steps=12, domains__adaptive=True, domains__smoothing=0.5)
    run_from_config(config, str(tmp_path / "run"))
    rows = read_metrics(str(tmp_path / "run"))
    for key in ("reward/digits", "reward/solved", "pass_rate/digits", "response_length/solved"):
        assert any(key in r for r in rows), key
    assert all(r.get("reward/solved", 1.0) == 1.0 for r in rows)
    first, last = rows[0]["domain_weight/digits"], rows[-1]["domain_weight/digits"]
    # "solved" never has signal: its weight falls toward the floor, "digits" takes the rest.
    assert first < last and last > 0.8, (first, last)
    assert rows[-1]["domain_weight/digits"] + rows[-1]["domain_weight/solved"] == pytest.approx(1)


def test_difficulty_filter_drops_prompts_without_signal(tmp_path):
    config = _config(tmp_path, train__steps=3, difficulty__samples=4, difficulty__prompts=64)
    summary = run_from_config(config, str(tmp_path / "run"))
    stats = summary["data"]["difficulty"]
    assert stats["estimated"] == 64 and stats["too_easy"] >= 32  # every "solved" prompt
    assert stats["kept"] == 256 - stats["too_easy"] - stats["too_hard"]
    saved = json.loads((tmp_path / "run" / "difficulty.json").read_text())
    assert len(saved["pass_rates"]) == 64
    rows = read_metrics(str(tmp_path / "run"))
    assert len(rows) == 3


def test_grouped_domain_updates_see_one_domain_and_both_rewards_rise(tmp_path):
    """domains.grouped: every step's batch (so each of its updates) holds one domain, drawn by
    weight; with two learnable domains both rewards rise; lr_scale and per-domain advantage
    normalisation run along."""
    config = _config(
        tmp_path,
        rewards__domains=LEARNABLE_REWARDS,
        train__steps=24,
        domains__grouped=True,
        domains__normalise_advantages=True,
        domains__lr_scale={"solved": 0.5},
    )
    run_from_config(config, str(tmp_path / "run"))
    rows = read_metrics(str(tmp_path / "run"))
    assert all(r["domains_in_batch"] == 1 for r in rows)
    for name in ("digits", "solved"):
        curve = [r[f"reward/{name}"] for r in rows if f"reward/{name}" in r]
        assert len(curve) >= 6, (name, len(curve))  # both domains are drawn
        assert all(f"reward/{other}" not in r for r in rows if f"reward/{name}" in r
                   for other in {"digits", "solved"} - {name})  # fmt: skip
        first, last = np.mean(curve[:3]), np.mean(curve[-3:])
        # Measured: digits 0.009 -> 0.046, solved (at half the learning rate) 0.27 -> 0.40.
        assert last > 1.3 * first and last > first + 0.02, (name, curve)
    assert any(f"entropy/{d}" in rows[0] for d in ("digits", "solved"))
    assert all(r["alert/entropy_collapse"] == 0 for r in rows[3:])


def test_per_domain_advantage_normalisation_and_update_scales():
    rng = np.random.default_rng(0)
    domain_ids = np.array([0, 0, 0, 0, 1, 1, 1, 1, -1, -1])
    adv = rng.normal(0, 1, 10).astype(np.float32) * np.where(domain_ids == 1, 10.0, 1.0)
    out = normalise_by_domain(adv, domain_ids, np.ones((10, 3)))
    for d in (0, 1):
        rows = domain_ids == d
        np.testing.assert_allclose(out[rows], adv[rows] / (adv[rows].std() + 1e-6), rtol=1e-6)
    np.testing.assert_array_equal(out[domain_ids < 0], adv[domain_ids < 0])
    # Per-token advantages: the std over the domain's trained tokens only.
    adv_BL = rng.normal(0, 1, (10, 3)).astype(np.float32)
    mask = (rng.uniform(size=(10, 3)) > 0.3).astype(np.float32)
    out = normalise_by_domain(adv_BL, domain_ids, mask)
    rows = domain_ids == 1
    want = adv_BL[rows] / (adv_BL[rows][mask[rows] > 0].std() + 1e-6)
    np.testing.assert_allclose(out[rows], want, rtol=1e-6)
    scales = update_scales(domain_ids, ("a", "b"), {"b": 0.5})
    np.testing.assert_array_equal(scales, [1, 1, 1, 1, 0.5, 0.5, 0.5, 0.5, 0.75, 0.75])


def test_update_scale_multiplies_the_optimizer_update():
    """An `update_scale` row field scales the step's update by its mean, as a learning-rate
    multiplier would (Adam's update is invariant to the loss's scale, so this is the only way)."""
    params = {"w": jnp.asarray([1.0, -2.0, 0.5])}
    optimizer = optax.adamw(0.1, weight_decay=0.01)
    state = create_state(params, optimizer, seed=0)

    def loss_fn(p, batch, rng):
        return {"loss_sum": jnp.sum((p["w"] * batch["x"][:, None]) ** 2), "num_tokens": 1.0}

    x = jnp.asarray([1.0, 2.0])
    moved = {}
    for scale in (None, 0.25):
        batch = {"x": x} if scale is None else {"x": x, "update_scale": jnp.full(2, scale)}
        new, _ = train_step(state, batch, loss_fn=loss_fn, optimizer=optimizer)
        moved[scale] = np.asarray(new.params["w"] - params["w"])
    np.testing.assert_allclose(moved[0.25], 0.25 * moved[None], rtol=1e-6)


def test_stability_monitor_warns_once_per_episode(caplog):
    monitor = StabilityMonitor(entropy_collapse=0.5, kl_max=0.1, warmup=2)
    entropies = [2.0, 2.0, 1.5, 0.9, 0.8, 1.2, 0.5]  # baseline 2.0: collapse below 1.0
    kls = [0.0, 0.01, 0.2, 0.3, 0.05, 0.05, 0.5]
    with caplog.at_level("WARNING", logger="posttrain.rl._domains"):
        alerts = [
            monitor(s, {"entropy": e, "kl": k})
            for s, (e, k) in enumerate(zip(entropies, kls, strict=True))
        ]
    assert [a.get("alert/entropy_collapse") for a in alerts] == [None, None, 0, 1, 1, 0, 1]
    assert [a["alert/kl_runaway"] for a in alerts] == [0, 0, 1, 1, 0, 0, 1]
    messages = [r.getMessage() for r in caplog.records]
    assert sum("stopped exploring" in m for m in messages) == 2  # steps 3 and 6, not 4
    assert sum("running away" in m for m in messages) == 2


def test_grouped_prompt_batches_hold_one_domain_by_weight_and_resume(tmp_path):
    path = two_domain_prompts(tmp_path / "prompts.jsonl")
    sources = (SourceConfig(path, weight=3.0, domain="digits"),)
    data = DataConfig(sources=sources, max_len=64, batch_size=4, num_epochs=None, seed=5)
    tokenizer = load_tokenizer(ASSETS_DIR / "tokenizer")
    prompts = PromptData(data, tokenizer, max_prompt_len=512, grouped=True)
    batches = [next(prompts) for _ in range(40)]
    assert all(len({p["domain"] for p in b}) == 1 and len(b) == 4 for b in batches)
    share = np.mean([b[0]["domain"] == "digits" for b in batches])
    assert 0.3 < share < 0.7  # (every record names its domain: equal base weights)
    state = prompts.get_state()
    ahead = [[p["record"] for p in next(prompts)] for _ in range(3)]
    again = PromptData(data, tokenizer, max_prompt_len=512, grouped=True)
    again.set_state(state)
    assert [[p["record"] for p in next(again)] for _ in range(3)] == ahead
