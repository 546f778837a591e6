"""MoE and MLA inside the decoder: cached decoding equals the full pass, the auxiliary loss and
expert counts reach the train step, the routing bias moves outside the optimizer, expert
parallelism of the whole model matches one device, and the real presets' active parameters."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from posttrain.models import (
    KVCache,
    Transformer,
    forward,
    get_preset,
    init_params,
    num_params,
    param_specs,
)
from posttrain.models._components import MLAConfig
from posttrain.models._presets import PUBLISHED_ACTIVE_PARAMS
from posttrain.parallel import MeshConfig, make_mesh, named_sharding, tree_shardings
from posttrain.train import sft_loss
from posttrain.train._run import decay_mask, routing_bias_update
from posttrain.train._state import create_state
from posttrain.train._step import train_step

MLA_MOE = get_preset("tiny_mla_moe")
QWEN_MOE = get_preset("tiny_moe")
MLA_NO_Q_LORA = MLA_MOE.replace(
    mla=MLAConfig(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
)


def _decisive(params, config, seed=0):
    """Router weights large enough that no two experts tie (sharded and single-device runs
    then pick the same experts), and a non-zero routing bias."""
    layers = dict(params["layers"])
    moe = dict(layers["moe"])
    moe["router"] = moe["router"] * 50
    if config.moe.use_routing_bias:
        moe["routing_bias"] = 0.05 * jax.random.normal(
            jax.random.key(seed), moe["routing_bias"].shape
        )
    layers["moe"] = moe
    return {**params, "layers": layers}


def _batch(config, B=8, L=16, seed=1):
    rng = np.random.RandomState(seed)
    tokens = rng.randint(0, config.vocab_size, (B, L)).astype(np.int32)
    segment_ids = np.ones((B, L), np.int32)
    segment_ids[0, 12:] = 0  # padding, left out of the balance losses and counts
    return {
        "tokens": tokens,
        "targets": np.roll(tokens, -1, axis=1),
        "loss_mask": (segment_ids > 0).astype(np.float32),
        "positions": np.broadcast_to(np.arange(L, dtype=np.int32), (B, L)).copy(),
        "segment_ids": segment_ids,
    }


@pytest.mark.parametrize("config", [MLA_MOE, MLA_NO_Q_LORA, QWEN_MOE], ids=["mla", "mla_q", "gqa"])
def test_cached_decoding_matches_the_full_pass(config):
    """MLA decodes over its cached latent with the up-projections absorbed; the result must
    equal the plain attention of the full pass."""
    params = _decisive(init_params(config, jax.random.key(0)), config)
    model = jax.jit(Transformer.__call__)
    tokens = jnp.asarray(_batch(config, B=2, L=12)["tokens"])
    full = model(Transformer(params, config), tokens)
    cache = KVCache.init(config, 2, 16)
    heads, k_dim, v_dim = config.cache_dims()
    assert cache.k_TBSKH.shape == (config.num_layers, 2, 16, heads, k_dim)
    if config.mla:  # one latent "head" per token, no separate values
        assert (heads, k_dim, v_dim) == (1, 32 + 8, 0)
    m = Transformer(params, config)
    logits, cache = model(m, tokens[:, :7], cache=cache)
    steps = [logits]
    for i in range(7, 12):
        position = jnp.full((2, 1), i, jnp.int32)
        logits, cache = model(m, tokens[:, i : i + 1], position, jnp.ones((2, 1), jnp.int32), cache)
        steps.append(logits)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=2e-5, rtol=0)


def test_dense_first_layers_are_their_own_stack():
    specs = param_specs(MLA_MOE)
    assert specs["dense_layers"]["mlp"]["gate"].shape == (1, 64, 128)
    assert specs["layers"]["moe"]["experts"]["gate"].shape == (2, 8, 64, 32)
    assert "mlp" not in specs["layers"] and "moe" not in specs["dense_layers"]
    with pytest.raises(ValueError, match="first_k_dense is only meaningful with moe"):
        get_preset("tiny", first_k_dense=1)


def _with(config, **moe_fields):
    return config.replace(moe=config.moe.__class__(**{**config.moe.__dict__, **moe_fields}))


def test_aux_loss_counts_and_routing_bias_in_the_train_step():
    """The aux loss enters the objective times its coefficient, the expert counts become
    metrics, and the routing bias moves by the balancing rule (its gradient is zero and weight
    decay skips it, so nothing else moves it)."""
    config = _with(MLA_MOE, aux_loss_coef=0.1, routing_bias_rate=0.01)
    params = _decisive(init_params(config, jax.random.key(0)), config)
    batch = jax.tree.map(jnp.asarray, _batch(config))
    loss_fn = sft_loss(config, 0.0)
    sums, plain, (_, aux), grads = jax.jit(
        lambda p, b: (
            loss_fn(p, b, None),
            sft_loss(_with(config, aux_loss_coef=0.0), 0.0)(p, b, None),
            forward(p, b["tokens"], config, b["positions"], b["segment_ids"], return_aux=True),
            jax.grad(lambda p: loss_fn(p, b, None)["loss_sum"])(p),
        )
    )(params, batch)
    n = float(sums["num_tokens"])
    np.testing.assert_allclose(
        float(sums["loss_sum"]),
        float(plain["loss_sum"]) + 0.1 * float(aux["aux_loss"]) * n,
        rtol=1e-6,
    )
    real = int(batch["segment_ids"].astype(bool).sum())
    counts = np.asarray(sums["moe/expert_counts"])
    assert counts.shape == (2, 8)
    np.testing.assert_array_equal(counts.sum(-1), [real * 2, real * 2])  # top-2 of real tokens
    assert np.abs(np.asarray(grads["layers"]["moe"]["routing_bias"])).max() == 0
    assert not decay_mask(config)["layers"]["moe"]["routing_bias"]
    assert routing_bias_update(_with(config, routing_bias_rate=0.0)) is None

    optimizer = optax.adamw(1e-2, weight_decay=0.1, mask=decay_mask(config))
    state = create_state(params, optimizer=optimizer, seed=0)
    step = jax.jit(
        lambda s, b: train_step(
            s, b, loss_fn=loss_fn, optimizer=optimizer, post_update=routing_bias_update(config)
        )
    )
    new_state, metrics = step(state, batch)
    assert metrics["moe/aux_loss"] >= 1.0 - 1e-6  # 1 when perfectly balanced
    total = sum(float(metrics[f"moe/tokens/{e}"]) for e in range(8))
    assert total == 2 * real * 2
    assert float(metrics["moe/load_max"]) >= 1.0 >= float(metrics["moe/load_min"])
    bias = np.asarray(params["layers"]["moe"]["routing_bias"])
    expected = bias + 0.01 * np.sign(counts.mean(-1, keepdims=True) - counts)
    new_bias = np.asarray(new_state.params["layers"]["moe"]["routing_bias"])
    np.testing.assert_allclose(new_bias, expected, atol=1e-7)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-12)


@pytest.mark.parametrize(  # all-expert ep8 (~35 s) in `make test-slow`
    "ici",
    [{"expert": 4, "fsdp": 2}, pytest.param({"expert": 8}, marks=pytest.mark.slow)],
    ids=["ep4_fsdp2", "ep8"],
)
def test_expert_parallel_model_matches_one_device(devices, ici):
    """The whole MLA+MoE model's SFT loss (with aux and z losses) and every gradient."""
    config = _with(MLA_MOE, aux_loss_coef=0.01, router_z_loss_coef=0.001)
    params = _decisive(init_params(config, jax.random.key(0)), config)
    batch = jax.tree.map(jnp.asarray, _batch(config))

    def objective(p, b):
        sums = sft_loss(config, 0.0)(p, b, None)
        return sums["loss_sum"] / sums["num_tokens"]

    grad_fn = jax.jit(jax.value_and_grad(objective))
    loss_ref, grads_ref = grad_fn(params, batch)

    mesh = make_mesh(MeshConfig.from_dict(ici), devices)
    axes = jax.tree.map(lambda s: s.axes, param_specs(config), is_leaf=lambda s: hasattr(s, "axes"))
    sharded = jax.device_put(params, tree_shardings(axes, params, mesh))
    assert sharded["layers"]["moe"]["experts"]["gate"].sharding.spec[1] == "expert"
    batch_sharded = {
        k: jax.device_put(v, named_sharding(("act_batch", None), v.shape, mesh))
        for k, v in batch.items()
    }
    with jax.set_mesh(mesh):
        compiled = grad_fn.lower(sharded, batch_sharded).compile()
        assert "all-to-all" in compiled.as_text()
        loss, grads = compiled(sharded, batch_sharded)
    assert _rel(loss, loss_ref) <= 1e-5
    for (path, g_ref), g in zip(
        jax.tree_util.tree_leaves_with_path(grads_ref), jax.tree.leaves(grads), strict=True
    ):
        if np.abs(np.asarray(g_ref)).max() == 0:  # the routing bias: selection only
            assert np.abs(np.asarray(g)).max() == 0, jax.tree_util.keystr(path)
        else:
            assert _rel(g, g_ref) <= 1e-5, jax.tree_util.keystr(path)


@pytest.mark.parametrize("name", sorted(PUBLISHED_ACTIVE_PARAMS))
def test_active_parameters_match_the_published_counts(name):
    """`flops_per_token` counts the experts a token visits; at length 0 it is 6 x active."""
    config = get_preset(name)
    active = config.flops_per_token(0) / 6
    assert abs(active / PUBLISHED_ACTIVE_PARAMS[name] - 1) < 0.03, f"{active / 1e9:.1f}B"
    assert active < num_params(config) / 10
