"""MoE router replay: the engine records every position's experts, the trainer replays them.

The sampler here runs the trainer's weights with a perturbed routing bias (std 0.002 on the
router scores): the bias only picks experts, never weighs them, so the sampler's routing
differs from the trainer's on some (token, layer) choices while everything else is the same
computation. That stands in for the rounding that flips top-k choices between a real engine
and trainer, and makes the test exact: with the sampler's routing replayed, the trainer's
log-probs of the sampled tokens are the sampler's (float32 rounding), without it they are not.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.config import ConfigError
from posttrain.methods import run_from_config
from posttrain.models import Transformer, get_preset, hidden_states, init_params, lm_logits
from posttrain.rl._loss import PolicyLossConfig, rl_loss, sequence_log_probs
from posttrain.rl._replay import check_router_replay, router_mismatch
from posttrain.rl._rollout_batch import rollout_batch
from posttrain.sampling import generate_continuous
from posttrain.train import read_metrics

from .toy import toy_config

BASE = get_preset("tiny_moe")
CONFIG = BASE.replace(moe=dataclasses.replace(BASE.moe, use_routing_bias=True))


def _with_bias(params, scale: float):
    """The params with a random routing bias of std `scale` in every MoE layer."""
    layers = dict(params["layers"])
    moe = dict(layers["moe"])
    moe["routing_bias"] = scale * jax.random.normal(jax.random.key(1), moe["routing_bias"].shape)
    layers["moe"] = moe
    return {**params, "layers": layers}


def _numpy_mismatch(own_BLTK, sampled_BLTK) -> tuple[float, int]:
    """(share of recorded (token, layer) choices whose expert sets differ, recorded tokens)."""
    differs, total, tokens = 0, 0, 0
    T, K = own_BLTK.shape[2:]
    pairs = zip(own_BLTK.reshape(-1, T, K), sampled_BLTK.reshape(-1, T, K), strict=True)
    for own_TK, sampled_TK in pairs:
        if sampled_TK[0, 0] < 0:
            continue
        tokens += 1
        for own_K, sampled_K in zip(own_TK, sampled_TK, strict=True):
            differs += set(own_K.tolist()) != set(sampled_K.tolist())
            total += 1
    return differs / total, tokens


def test_replaying_the_models_own_routing_changes_nothing():
    """Replay with the routing the model chose itself is bitwise the unreplayed pass (a DeepSeek-
    like config: a dense first layer, sigmoid scores, group-limited routing, a routing bias);
    other experts change the output, and the returned routing is the router's own choice."""
    config = get_preset("tiny_mla_moe")
    params = _with_bias(init_params(config, jax.random.key(0)), 0.05)
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 512, (2, 12)), jnp.int32)
    hidden, aux = hidden_states(params, tokens, config, return_aux=True)
    own = aux["routed_experts"]
    assert own.shape == (2, 12, config.num_moe_layers, config.moe.top_k)
    replayed, aux_r = hidden_states(
        params, tokens, config, return_aux=True, replay_experts_BLTK=own
    )
    np.testing.assert_array_equal(np.asarray(replayed), np.asarray(hidden))
    np.testing.assert_array_equal(np.asarray(aux_r["routed_experts"]), np.asarray(own))
    # -1 keeps a token's own routing; other experts change the output.
    keep = jnp.full_like(own, -1)
    np.testing.assert_array_equal(
        np.asarray(hidden_states(params, tokens, config, replay_experts_BLTK=keep)),
        np.asarray(hidden),
    )
    other = (own + 1) % config.moe.num_experts
    moved = hidden_states(params, tokens, config, replay_experts_BLTK=other)
    assert float(jnp.abs(moved - hidden).max()) > 1e-2
    # The logits see the replay too (the trainer's log-prob passes go through hidden_states).
    assert lm_logits(params, moved, config).shape == (2, 12, config.vocab_size)


@pytest.fixture(scope="module")
def sampled():
    """(trainer params, sampler model, the rollout batch of its samples with their routing)."""
    params = init_params(CONFIG, jax.random.key(0))
    sampler = Transformer(_with_bias(params, 0.002), CONFIG)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(1, 512, rng.randint(5, 12)).tolist() for _ in range(4)]
    groups = generate_continuous(sampler, None, prompts, max_new_tokens=8, n=2, temperature=1.0,
                                 record_routes=True, slots=8)  # fmt: skip
    T, K = CONFIG.num_moe_layers, CONFIG.moe.top_k
    for p, group in zip(prompts, groups, strict=True):
        for c in group:
            assert c.routed_experts.shape == (len(p) + len(c.token_ids), T, K)
            assert c.routed_experts.dtype == np.int16
    max_len = 24
    records = [{"prompt_ids": p, "domain_id": 0} for p in prompts]
    batch = rollout_batch(
        records, groups, np.zeros((4, 2)), groups=4, max_len=max_len, route_shape=(T, K)
    )
    return params, sampler, batch


def test_replay_makes_the_trainers_logprobs_the_samplers(sampled):
    params, sampler, batch = sampled
    max_len = batch["tokens"].shape[1]
    lengths = (batch["segment_ids"] > 0).sum(axis=1)
    recorded = batch["routed_experts"][..., 0, 0] >= 0
    np.testing.assert_array_equal(recorded, np.arange(max_len) < lengths[:, None])
    device = {k: jnp.asarray(v) for k, v in batch.items()}
    mask = batch["loss_mask"] > 0

    def gap(logps):
        return float(np.abs(np.asarray(logps) - batch["sampler_logps"])[mask].max())

    # The engine recorded what the sampler's model routes in a full pass (prompt included).
    _, aux = hidden_states(sampler.params, device["tokens"], CONFIG, device["positions"],
                           device["segment_ids"], return_aux=True)  # fmt: skip
    assert _numpy_mismatch(np.asarray(aux["routed_experts"]), batch["routed_experts"])[0] == 0.0
    # The trainer routes differently: its log-probs are off by far more than rounding ...
    unreplayed = gap(sequence_log_probs(params, CONFIG, device))
    replayed = gap(
        sequence_log_probs(params, CONFIG, device, replay_experts_BLTK=device["routed_experts"])
    )
    assert unreplayed > 1e-3, unreplayed
    # ... and with the sampler's routing replayed they are the sampler's.
    assert replayed < 1e-5, replayed
    # router_mismatch: the share of recorded (token, layer) choices that differ, as NumPy counts.
    _, own = hidden_states(params, device["tokens"], CONFIG, device["positions"],
                           device["segment_ids"], return_aux=True)  # fmt: skip
    own = own["routed_experts"]
    share, tokens = _numpy_mismatch(np.asarray(own), batch["routed_experts"])
    mismatch_BL, recorded_BL = router_mismatch(own, device["routed_experts"])
    assert float(recorded_BL.sum()) == tokens == lengths.sum()
    assert float((mismatch_BL * recorded_BL).sum() / recorded_BL.sum()) == pytest.approx(share)
    assert share > 0.02, share


def test_the_update_replays_and_logs_the_mismatch(sampled):
    """In the loss pass: "update" replays (the first update's ratio against replayed old
    log-probs is exactly 1), "logprob" does not (ratio != 1); both log router_mismatch as the
    share of recorded (token, layer) choices where the trainer's top-k differs."""
    params, _, batch = sampled
    device = {k: jnp.asarray(v) for k, v in batch.items()}
    old = sequence_log_probs(params, CONFIG, device, replay_experts_BLTK=device["routed_experts"])
    rows = batch["tokens"].shape[0]
    device.update(old_logps=old, advantages=jnp.ones(rows), truncated=jnp.zeros(rows))
    _, aux = hidden_states(params, device["tokens"], CONFIG, device["positions"],
                           device["segment_ids"], return_aux=True)  # fmt: skip
    share, _ = _numpy_mismatch(np.asarray(aux["routed_experts"]), batch["routed_experts"])
    for mode in ("update", "logprob"):
        loss = rl_loss(CONFIG, PolicyLossConfig(router_replay=mode), max_new_tokens=8,
                       use_reference=False)  # fmt: skip
        sums = jax.jit(loss)(params, device, None)
        ratio = float(sums["ratio_sum"] / sums["ratio_count"])
        if mode == "update":
            assert ratio == pytest.approx(1.0, abs=1e-6)
        else:
            assert abs(ratio - 1.0) > 1e-4, ratio
        mismatch = float(sums["router_mismatch_sum"] / sums["router_mismatch_count"])
        assert mismatch == pytest.approx(share, abs=1e-6)


def test_router_replay_settings_are_checked():
    with pytest.raises(ConfigError, match="router_replay"):
        PolicyLossConfig(router_replay="always")
    dense = toy_config("tiny", loss__router_replay="update")
    with pytest.raises(ConfigError, match="dense"):
        check_router_replay(dense, get_preset("tiny"))
    # Speculative rounds write several positions at once: the engine records no routing then.
    drafted = toy_config("tiny", loss__router_replay="logprob", rollout__engine__speculative=2)
    with pytest.raises(ConfigError, match="rollout.engine.speculative=0"):
        check_router_replay(drafted, BASE)
    check_router_replay(toy_config("tiny", loss__router_replay="update"), BASE)


@pytest.mark.slow
def test_a_grpo_run_with_router_replay_logs_the_mismatch(tmp_path):
    """A short GRPO run of a tiny MoE replaying the sampler's routing in every pass: it trains,
    logs router_mismatch each step, and on policy in float32 the engine's routing is the
    trainer's (mismatch 0, log-prob gap at rounding)."""
    config = toy_config(
        "tiny",
        model__preset="tiny_moe",
        loss__router_replay="update",
        train__steps=2,
        data__batch_size=2,
        rollout__num_generations=4,
    )
    summary = run_from_config(config, str(tmp_path))
    rows = read_metrics(str(tmp_path))
    assert summary["final_step"] == 2 and len(rows) == 2
    assert all(r["router_mismatch"] == 0.0 for r in rows), [r["router_mismatch"] for r in rows]
    assert all(r["logp_gap"] < 1e-5 for r in rows), [r["logp_gap"] for r in rows]
