"""LoRA (and QLoRA) beyond SFT: DPO with the base as its reference, reward models, GRPO with
merged weights (co-located) or adapters only (decoupled) sent to the sampler."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain import cli
from posttrain.config import load_config_file, override
from posttrain.demo import ASSETS_DIR
from posttrain.lora import (
    LoRAConfig,
    Policy,
    adapter_shapes,
    init_adapters,
    param_bytes,
    quantize_params,
    saved_base,
    target_paths,
    wrap,
)
from posttrain.methods import run_from_config
from posttrain.models import (
    checkpoint_json,
    forward,
    from_hf,
    get_preset,
    init_params,
    param_shapes,
)
from posttrain.rewards import reward_scores
from posttrain.rewards import without_lm_head as _trunk
from posttrain.rl._loss import PolicyLossConfig, rl_loss, sequence_log_probs
from posttrain.testing import hf_logits, save_tiny_hf_model
from posttrain.train import load_checkpoint_model, load_lora_params, load_reward_model, read_metrics
from tests.rl.toy import REPO, toy_config
from tests.train.conftest import small_config
from tests.train.test_dpo_driver import _config as dpo_config
from tests.train.test_dpo_driver import pair_files  # noqa: F401 (a fixture)

LORA = {"lora.enabled": True, "lora.rank": 8, "optimizer.learning_rate": 1e-2}


def _assert_is_fresh_init(base, model_config, seed=0):
    """The frozen base is bitwise the random init the run started from."""
    fresh = init_params(model_config, jax.random.key(seed))
    for x, y in zip(jax.tree.leaves(base), jax.tree.leaves(fresh), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _adapters_only(params, model_config, lora):
    assert jax.tree.structure(params) == jax.tree.structure(adapter_shapes(model_config, lora))


@pytest.mark.slow  # three DPO runs, ~100 s on 2 cores
def test_dpo_reference_is_the_base_with_adapters_off(pair_files, tmp_path):  # noqa: F811
    losses, stored = {}, {}
    for name, overrides in {
        "full": {"train.steps": 1},
        "on_the_fly": {**LORA, "loss.reference": "on_the_fly"},
        "precomputed": {**LORA, "loss.reference": "precomputed"},
    }.items():
        config = dpo_config(pair_files, **overrides)
        summary = run_from_config(config, str(tmp_path / name))
        rows = read_metrics(str(tmp_path / name))
        losses[name] = [r["loss"] for r in rows]
        if name != "on_the_fly":
            with np.load(tmp_path / name / "reference" / "train.process_0.npz") as f:
                stored[name] = (f["chosen"], f["rejected"])
    # The LoRA run's precomputed reference (its base, adapters off) is the full run's.
    for a, b in zip(stored["precomputed"], stored["full"], strict=True):
        np.testing.assert_array_equal(a, b)
    # Step 1: zero B, so policy == reference: the DPO loss is log 2 exactly as for full DPO.
    assert losses["on_the_fly"][0] == pytest.approx(np.log(2), abs=1e-6)
    np.testing.assert_allclose(losses["on_the_fly"], losses["precomputed"], atol=1e-5)
    final = read_metrics(str(tmp_path / "on_the_fly"), "eval")[-1]
    assert final["eval_accuracy"] >= 0.8 and final["eval_loss"] < np.log(2), final
    lora_params, adapters, lora = load_lora_params(str(tmp_path / "on_the_fly"), merged=False)
    _adapters_only(summary["state"].params, summary["model_config"], lora)
    _assert_is_fresh_init(lora_params, summary["model_config"])


# Adapters plus a trained head: the PPO plan in tests/test_aot.py (default) trains the same set.
@pytest.mark.slow  # ~70 s
def test_reward_model_trains_adapters_and_its_heads(pair_files, tmp_path):  # noqa: F811
    dpo = dpo_config(pair_files)
    values = {k: dpo[k] for k in ("tokenizer", "data", "eval_data", "train", "checkpoint", "mesh")}
    config = override(load_config_file(os.path.join(REPO, "configs", "rm.py") + ":tiny"), {
        **values, "model.checkpoint": "", "train.steps": 20, "optimizer.warmup_steps": 0, **LORA,
    })  # fmt: skip
    workdir = str(tmp_path / "rm")
    summary = run_from_config(config, workdir)
    state = summary["state"]
    assert set(state.params) == {"adapters", "head"}
    final = read_metrics(workdir, "eval")[-1]
    assert final["eval_accuracy"] >= 0.8, final
    # The saved reward model (adapters merged into the trunk) scores as base + adapters.
    rm = load_reward_model(workdir)
    base, lora = saved_base(checkpoint_json(workdir))
    tokens = jnp.asarray(np.random.RandomState(0).randint(1, 500, (4, 12)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(12), (4, 12))
    segments, heads = jnp.ones((4, 12), jnp.int32), jnp.asarray([0, 1, 0, 1])
    params, kwargs = wrap(lora, _trunk(base), state.params["adapters"])
    wrapped = reward_scores(
        {"trunk": params, "head": state.params["head"]},
        rm.model_config, tokens, positions, segments, heads, **kwargs,
    )  # fmt: skip
    merged = reward_scores(rm.params, rm.model_config, tokens, positions, segments, heads)
    np.testing.assert_allclose(np.asarray(merged), np.asarray(wrapped), atol=1e-5)
    assert not np.allclose(np.asarray(state.params["head"]), 0.0)


def _rl_batch(model_config, params):
    B, L = 4, 12
    tokens = jnp.asarray(np.random.RandomState(0).randint(1, 500, (B, L)), jnp.int32)
    batch = {
        "tokens": tokens,
        "targets": jnp.roll(tokens, -1, axis=1),
        "positions": jnp.broadcast_to(jnp.arange(L), (B, L)),
        "segment_ids": jnp.ones((B, L), jnp.int32),
        "loss_mask": jnp.asarray(np.arange(L)[None].repeat(B, 0) >= 5, jnp.float32),
        "advantages": jnp.asarray([1.0, -1.0, 0.5, -0.5]),
        "truncated": jnp.zeros(B),
        "domain_ids": jnp.zeros(B, jnp.int32),
    }
    batch["old_logps"] = batch["sampler_logps"] = sequence_log_probs(params, model_config, batch)
    return batch


@pytest.mark.parametrize(
    "preset", ["tiny", pytest.param("tiny_mla_moe", marks=pytest.mark.slow)]
)  # MLA/MoE adapters: tests/lora/test_adapters.py; this one ~65 s
def test_policy_gradient_on_adapters_is_the_chain_rule_of_the_full_one(preset):
    """At B = 0, dL/dB = scale * A^T dL/dW and dL/dA = 0: the LoRA policy loss differentiates
    the same objective as full fine-tuning."""
    model_config = get_preset(preset)
    base = init_params(model_config, jax.random.key(0))
    lora = LoRAConfig(rank=4, targets=(".",))
    adapters = init_adapters(model_config, lora, jax.random.key(1))
    batch = _rl_batch(model_config, base)
    common = dict(max_new_tokens=7, use_reference=False)
    full = rl_loss(model_config, PolicyLossConfig(), **common)
    wrapped = rl_loss(model_config, PolicyLossConfig(), **common, policy=Policy(lora, base))
    g_full = jax.grad(lambda p: full(p, batch, None)["loss_sum"])(base)
    g_lora = jax.grad(lambda a: wrapped(a, batch, None)["loss_sum"])(adapters)
    for path in target_paths(model_config, lora):
        g_w = g_full
        adapter, grads = adapters, g_lora
        for key in path:
            g_w, adapter, grads = g_w[key], adapter[key], grads[key]
        a = adapter["a"]
        lead = a.ndim + adapter["b"].ndim - 2 - g_w.ndim
        a2 = a.reshape(*a.shape[: lead + 1], -1)  # [*lead, r, in]
        g2 = g_w.reshape(*a2.shape[:lead], a2.shape[-1], -1)  # [*lead, in, out]
        expected = lora.scale * jnp.einsum("...ri,...io->...ro", a2, g2)
        # Two contractions of the same terms in other orders: exact to a small multiple of eps
        # times the terms' size, which the leaf's largest gradient bounds (tests/README.md).
        expected = np.asarray(expected)
        np.testing.assert_allclose(
            np.asarray(grads["b"]).reshape(expected.shape), expected, rtol=1e-4,
            atol=1e-5 * np.abs(expected).max(), err_msg="/".join(path),
        )  # fmt: skip
        assert not np.any(np.asarray(grads["a"]))


def test_grpo_with_lora_samples_the_merged_policy(tmp_path):
    overrides = {
        "lora__enabled": True,
        "lora__rank": 8,
        "optimizer__learning_rate": 2e-2,
        "kl__coef": 0.05,
        "train__steps": 4,
    }
    summary = run_from_config(toy_config(**overrides), str(tmp_path))
    rows = read_metrics(str(tmp_path))
    # The sampler ran the merged weights: its log-probs are the trainer's (base + adapters).
    assert all(r["logp_gap"] < 1e-3 for r in rows)
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # reference: the base, adapters off
    assert rows[-1]["kl"] > 0
    base, adapters, lora = load_lora_params(str(tmp_path), merged=False)
    _adapters_only(summary["state"].params, summary["model_config"], lora)
    _assert_is_fresh_init(base, summary["model_config"])
    model = load_checkpoint_model(str(tmp_path))
    tokens = jnp.asarray(np.random.RandomState(2).randint(1, 500, (2, 10)), jnp.int32)
    params, kwargs = wrap(lora, base, adapters)
    np.testing.assert_allclose(
        np.asarray(model(tokens)),
        np.asarray(forward(params, tokens, model.config, **kwargs)),
        atol=1e-5,
    )


def test_decoupled_sampler_is_sent_only_the_adapters(tmp_path, devices):
    overrides = {
        "lora__enabled": True,
        "lora__rank": 4,
        "lora__quantize": "int8",
        "optimizer__learning_rate": 2e-2,
        "train__steps": 4,
        "rollout__sampler_devices": 4,
        "rollout__max_staleness": 0,
    }
    summary = run_from_config(toy_config(**overrides), str(tmp_path))
    rows = read_metrics(str(tmp_path))
    assert [r["staleness"] for r in rows] == [0.0] * 4
    # max_staleness 0 is on-policy: the sampler's merged weights are the trainer's policy.
    assert all(r["logp_gap"] < 1e-3 for r in rows)
    model_config = summary["model_config"]
    adapters = param_bytes(summary["state"].params)
    assert all(r["sync_bytes"] == adapters for r in rows)
    assert adapters * 10 < param_bytes(param_shapes(model_config))


@pytest.mark.parametrize("quantize", [pytest.param("int8", marks=pytest.mark.slow), "nf4"])
def test_qlora_sft_trains_adapters_on_a_quantised_base(quantize, tmp_path, caplog):
    overrides = {
        "lora__enabled": True,
        "lora__quantize": quantize,
        "optimizer__learning_rate": 1e-2,
        "train__steps": 24,
        "checkpoint__every": 24,
        # int8: the quantised base (codes and scales) and the adapters sharded over fsdp=4
        "mesh__ici__fsdp": 4 if quantize == "int8" else 1,
    }
    with caplog.at_level("INFO"):
        summary = run_from_config(small_config(**overrides), str(tmp_path))
    losses = [r["loss"] for r in read_metrics(str(tmp_path))]
    assert np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.25, losses  # 6.12 -> 5.71 (int8)
    model_config = summary["model_config"]
    base, adapters, lora = load_lora_params(str(tmp_path), merged=False)
    # The run's frozen base is the quantised random init, and what it trained against.
    fresh = quantize_params(init_params(model_config, jax.random.key(0)), model_config, quantize)
    for x, y in zip(jax.tree.leaves(summary["base_params"]), jax.tree.leaves(fresh), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    if quantize == "int8":
        codes = summary["base_params"]["layers"]["mlp"]["up"].codes
        assert len(codes.sharding.device_set) == 8 and not codes.sharding.is_fully_replicated
    full, stored = param_bytes(param_shapes(model_config)), param_bytes(summary["base_params"])
    assert stored < full * (0.6 if quantize == "int8" else 0.5), (stored, full)
    assert f"QLoRA: the frozen base takes {stored / 2**30:.3f} GiB stored as {quantize}" in (
        caplog.text
    )
    # The checkpoint loads as one plain model: dequantised base + merged adapters.
    model = load_checkpoint_model(str(tmp_path))
    tokens = jnp.asarray(np.random.RandomState(3).randint(1, 500, (2, 16)), jnp.int32)
    params, kwargs = wrap(lora, base, adapters)
    np.testing.assert_allclose(
        np.asarray(model(tokens)),
        np.asarray(forward(params, tokens, model_config, **kwargs)),
        atol=1e-5,
    )


def test_qlora_from_an_hf_base_exports_what_it_trained(tmp_path):
    """A QLoRA run on an HF model directory: the checkpoint's pointer rebuilds the (quantised)
    base, and the merged export loaded by transformers gives the run's logits."""
    hf_dir = save_tiny_hf_model("llama3", str(tmp_path / "hf"), vocab_size=512)
    overrides = {
        "model__hf_path": hf_dir,
        "tokenizer": str(ASSETS_DIR / "tokenizer"),
        "lora__enabled": True,
        "lora__quantize": "int8",
        "optimizer__learning_rate": 1e-2,
        "train__steps": 4,
    }
    run_from_config(small_config(**overrides), str(tmp_path / "run"))
    saved = checkpoint_json(str(tmp_path / "run"))
    assert saved["lora"]["base"]["hf_path"] == hf_dir
    base, adapters, lora = load_lora_params(str(tmp_path / "run"), merged=False)
    assert not np.allclose(np.asarray(jax.tree.leaves(adapters)[1]), 0.0)  # b moved
    tokens = np.random.RandomState(4).randint(1, 512, (2, 16)).astype(np.int32)
    params, kwargs = wrap(lora, base, adapters)
    trained = forward(params, jnp.asarray(tokens), from_hf(hf_dir).config, **kwargs)
    out = tmp_path / "merged"
    assert cli.main(["export", f"--workdir={tmp_path / 'run'}", f"--out={out}"]) == 0
    np.testing.assert_allclose(hf_logits(str(out), tokens), np.asarray(trained), atol=1e-4)
