"""The MoE layer against a per-token NumPy loop: routing variants, capacity drops, losses, and
expert parallelism on 8 fake CPU devices (same output, loss and gradients as one device)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.models import ParamSpec
from posttrain.models._moe import (
    MoEConfig,
    init_moe_params,
    moe_forward,
    moe_param_specs,
    update_routing_bias,
)
from posttrain.parallel import MeshConfig, make_mesh, named_sharding, tree_shardings

D = 16
BASE = MoEConfig(num_experts=8, top_k=2, expert_mlp_dim=8)
DEEPSEEK = dataclasses.replace(
    BASE,
    score_func="sigmoid",
    n_group=4,
    topk_group=2,
    use_routing_bias=True,
    routed_scaling_factor=2.5,
    num_shared_experts=2,
)


def _params(config, seed=0):
    params = init_moe_params(config, D, jax.random.key(seed))
    # Larger router weights give the router decisive, tie-free choices.
    params["router"] = params["router"] * 50
    if config.use_routing_bias:
        params["routing_bias"] = 0.05 * jax.random.normal(jax.random.key(seed + 1), (8,))
    return params


def _x(B=2, L=8, seed=1):
    return jax.random.normal(jax.random.key(seed), (B, L, D), jnp.float32)


def _silu(x):
    return x / (1 + np.exp(-x))


def _swiglu(x, gate, up, down):
    return (_silu(x @ gate) * (x @ up)) @ down


def _capacity_keep(capacity):
    """Which assignments fit `capacity` slots per expert, filled first choices first."""

    def keep_fn(chosen):
        keep, filled = np.ones(chosen.shape, bool), np.zeros(chosen.max() + 1, int)
        for k in range(chosen.shape[1]):
            for m in range(chosen.shape[0]):
                keep[m, k] = filled[chosen[m, k]] < capacity
                filled[chosen[m, k]] += 1
        return keep

    return keep_fn


def _reference(params, x_BLD, config, keep_fn=None):
    """Per-token loop in float64; `keep_fn(chosen_MK) -> keep_MK` drops assignments."""
    c = config
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x_MD = np.asarray(x_BLD, np.float64).reshape(-1, D)
    M, E, K = x_MD.shape[0], c.num_experts, c.top_k
    chosen, weights = np.zeros((M, K), int), np.zeros((M, K))
    for m in range(M):
        logits = x_MD[m] @ p["router"]
        if c.score_func == "softmax":
            scores = np.exp(logits - logits.max())
            scores /= scores.sum()
        else:
            scores = 1 / (1 + np.exp(-logits))
        choice = scores + (p["routing_bias"] if c.use_routing_bias else 0)
        allowed = np.ones(E, bool)
        if c.n_group > 1:
            groups = choice.reshape(c.n_group, -1)
            group_scores = np.sort(groups, axis=1)[:, -2:].sum(1)
            kept = np.argsort(-group_scores)[: c.topk_group]
            allowed = np.isin(np.arange(E) // (E // c.n_group), kept)
        top = [e for e in np.argsort(-choice) if allowed[e]][:K]
        w = scores[top]
        if c.norm_topk_prob:
            w = w / w.sum()
        chosen[m], weights[m] = top, w * c.routed_scaling_factor
    keep = np.ones((M, K), bool) if keep_fn is None else keep_fn(chosen)
    y = np.zeros_like(x_MD)
    ex = p["experts"]
    for m in range(M):
        for k in range(K):
            if keep[m, k]:
                e = chosen[m, k]
                y[m] += weights[m, k] * _swiglu(x_MD[m], ex["gate"][e], ex["up"][e], ex["down"][e])
        if c.num_shared_experts:
            y[m] += _swiglu(x_MD[m], p["shared"]["gate"], p["shared"]["up"], p["shared"]["down"])
    return y.reshape(x_BLD.shape), chosen, keep


@pytest.mark.parametrize(
    "config",
    [
        BASE,
        dataclasses.replace(BASE, norm_topk_prob=False, num_shared_experts=1),
        dataclasses.replace(BASE, n_group=4, topk_group=2, use_routing_bias=True),
        dataclasses.replace(BASE, score_func="sigmoid"),
        DEEPSEEK,
    ],
    ids=["softmax", "softmax_unnormalised_shared", "softmax_groups_bias", "sigmoid", "deepseek"],
)
def test_dropless_matches_per_token_loop(config):
    params, x = _params(config), _x()
    y, aux = jax.jit(lambda p, x: moe_forward(p, x, config))(params, x)
    expected, chosen, _ = _reference(params, x, config)
    np.testing.assert_allclose(np.asarray(y), expected, atol=1e-5)
    np.testing.assert_array_equal(aux["expert_counts"], np.bincount(chosen.ravel(), minlength=8))
    assert float(aux["dropped_fraction"]) == 0.0


def test_routing_bias_changes_selection_not_weights():
    config = dataclasses.replace(BASE, use_routing_bias=True)
    params, x = _params(config), _x()
    params["routing_bias"] = jnp.zeros(8).at[3].set(10.0)  # expert 3 always chosen
    y, aux = jax.jit(lambda p, x: moe_forward(p, x, config))(params, x)
    assert int(aux["expert_counts"][3]) == 16
    expected, _, _ = _reference(params, x, config)
    np.testing.assert_allclose(np.asarray(y), expected, atol=1e-5)


def test_capacity_with_room_for_everything_equals_dropless():
    config = dataclasses.replace(DEEPSEEK, dispatch="capacity", capacity_factor=100.0)
    params, x = _params(config), _x()
    y, aux = moe_forward(params, x, config)
    dropless, _ = moe_forward(params, x, dataclasses.replace(config, dispatch="dropless"))
    np.testing.assert_allclose(np.asarray(y), np.asarray(dropless), atol=1e-6)
    assert float(aux["dropped_fraction"]) == 0.0


def test_capacity_drops_are_counted_and_leave_the_shared_expert():
    config = dataclasses.replace(
        BASE, num_shared_experts=1, dispatch="capacity", capacity_factor=0.25
    )
    params, x = _params(config), _x()
    y, aux = jax.jit(lambda p, x: moe_forward(p, x, config))(params, x)
    M, K, E = 16, config.top_k, config.num_experts
    capacity = math.ceil(config.capacity_factor * M * K / E)
    expected, _, keep = _reference(params, x, config, _capacity_keep(capacity))
    np.testing.assert_allclose(np.asarray(y), expected, atol=1e-5)
    np.testing.assert_allclose(float(aux["dropped_fraction"]), 1 - keep.mean(), rtol=1e-6)
    assert 0 < keep.mean() < 1
    fully_dropped = ~keep.any(axis=1)
    assert fully_dropped.any()
    x_MD = np.asarray(x, np.float64).reshape(-1, D)
    s = jax.tree.map(lambda a: np.asarray(a, np.float64), params["shared"])
    shared_only = _swiglu(x_MD[fully_dropped], s["gate"], s["up"], s["down"])
    np.testing.assert_allclose(np.asarray(y).reshape(-1, D)[fully_dropped], shared_only, atol=1e-6)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_losses_and_counts_match_formulas(score_func):
    config = dataclasses.replace(
        BASE, score_func=score_func, aux_loss_coef=0.01, router_z_loss_coef=0.001
    )
    params, x = _params(config), _x()
    mask_BL = np.ones((2, 8), np.int32)
    mask_BL[1, 5:] = 0  # padding: left out of losses and counts
    _, aux = moe_forward(params, x, config, token_mask_BL=jnp.asarray(mask_BL))
    _, chosen, _ = _reference(params, x, config)
    real = mask_BL.reshape(-1).astype(bool)
    logits = np.asarray(x, np.float64).reshape(-1, D)[real] @ np.asarray(params["router"])
    if score_func == "softmax":
        probs = np.exp(logits - logits.max(1, keepdims=True))
    else:
        probs = 1 / (1 + np.exp(-logits))
    probs /= probs.sum(1, keepdims=True)
    counts = np.bincount(chosen[real].ravel(), minlength=8)
    n, K, E = real.sum(), config.top_k, config.num_experts
    aux_loss = E * np.sum(counts / (n * K) * probs.mean(0))
    lse = logits.max(1) + np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1))
    z_loss = np.mean(lse**2)
    np.testing.assert_array_equal(aux["expert_counts"], counts)
    assert int(aux["expert_counts"].sum()) == n * K
    np.testing.assert_allclose(float(aux["aux_loss"]), aux_loss, rtol=1e-5)
    np.testing.assert_allclose(float(aux["z_loss"]), z_loss, rtol=1e-5)
    np.testing.assert_allclose(float(aux["loss"]), 0.01 * aux_loss + 0.001 * z_loss, rtol=1e-5)


def _loss(params, x, config):
    y, aux = moe_forward(params, x, config)
    return jnp.sum(y**2) + aux["loss"]


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


@pytest.mark.parametrize(
    "ici",
    [{"expert": 4, "fsdp": 2}, {"expert": 8}, {"expert": 2, "fsdp": 2, "tensor": 2}],
    ids=["expert4_fsdp2", "expert8", "expert2_fsdp2_tensor2"],
)
def test_expert_parallel_matches_one_device(devices, ici):
    config = dataclasses.replace(DEEPSEEK, aux_loss_coef=0.01, router_z_loss_coef=0.001)
    params, x = _params(config), _x(B=8, L=8)
    y_ref, _ = jax.jit(lambda p, x: moe_forward(p, x, config))(params, x)
    loss_ref, grads_ref = jax.jit(jax.value_and_grad(_loss), static_argnums=2)(params, x, config)

    mesh = make_mesh(MeshConfig.from_dict(ici), devices)
    axes = jax.tree.map(
        lambda s: s.axes, moe_param_specs(config, D), is_leaf=lambda s: isinstance(s, ParamSpec)
    )
    params_sharded = jax.device_put(params, tree_shardings(axes, params, mesh))
    x_sharded = jax.device_put(
        x, named_sharding(("act_batch", "act_length", "act_embed"), x.shape, mesh)
    )
    with jax.set_mesh(mesh):
        forward = jax.jit(lambda p, x: moe_forward(p, x, config))
        assert "all_to_all" in forward.lower(params_sharded, x_sharded).as_text()
        y, aux = forward(params_sharded, x_sharded)
        loss, grads = jax.jit(jax.value_and_grad(_loss), static_argnums=2)(
            params_sharded, x_sharded, config
        )
    assert float(aux["dropped_fraction"]) == 0.0
    assert _rel(y, y_ref) <= 1e-5
    assert _rel(loss, loss_ref) <= 1e-5
    flat_ref = jax.tree_util.tree_leaves_with_path(grads_ref)
    for (path, g_ref), g in zip(flat_ref, jax.tree.leaves(grads), strict=True):
        if np.abs(np.asarray(g_ref)).max() == 0:  # the routing bias: selection only
            assert np.abs(np.asarray(g)).max() == 0, jax.tree_util.keystr(path)
        else:
            assert _rel(g, g_ref) <= 1e-5, jax.tree_util.keystr(path)


def test_expert_parallel_buffer_overflow_is_counted(devices):
    config = dataclasses.replace(BASE, ep_capacity_factor=0.5)
    params, x = _params(config), _x(B=8, L=8)
    mesh = make_mesh(MeshConfig.from_dict({"expert": 8}), devices)
    y, aux = jax.jit(lambda p, x: moe_forward(p, x, config, mesh=mesh))(params, x)

    # Device d holds tokens 8d..8d+7 and expert d; a buffer has ceil(0.5 * 8 * 2 / 8) = 1 slot
    # per destination, so each device keeps only its first assignment to each expert.
    def keep_fn(chosen_MK):
        per_device = [_capacity_keep(1)(c.reshape(-1, 1)) for c in np.split(chosen_MK, 8)]
        return np.concatenate(per_device).reshape(chosen_MK.shape)

    expected, _, keep = _reference(params, x, config, keep_fn)
    np.testing.assert_allclose(np.asarray(y), expected, atol=1e-5)
    np.testing.assert_allclose(float(aux["dropped_fraction"]), 1 - keep.mean(), rtol=1e-6)
    assert 0 < keep.mean() < 1


def test_expert_parallel_pads_fewer_tokens_than_devices(devices):
    config = dataclasses.replace(BASE, num_shared_experts=1)
    params, x = _params(config), _x(B=1, L=3)  # a decoding step: 3 tokens on 8 devices
    mesh = make_mesh(MeshConfig.from_dict({"expert": 8}), devices)
    y, aux = jax.jit(lambda p, x: moe_forward(p, x, config, mesh=mesh))(params, x)
    expected, _, _ = _reference(params, x, config)
    np.testing.assert_allclose(np.asarray(y), expected, atol=1e-5)
    assert float(aux["dropped_fraction"]) == 0.0


def test_param_specs_and_errors(devices):
    specs = moe_param_specs(DEEPSEEK, D, num_layers=3)
    assert specs["experts"]["gate"] == ParamSpec(
        (3, 8, D, 8), ("layers", "experts", "embed", "mlp")
    )
    assert specs["experts"]["down"].axes == ("layers", "experts", "mlp", "embed")
    assert specs["router"].shape == (3, D, 8) and specs["routing_bias"].init == "zeros"
    assert specs["shared"]["gate"].shape == (3, D, 16)
    assert "shared" not in moe_param_specs(BASE, D) and "routing_bias" not in moe_param_specs(
        BASE, D
    )

    with pytest.raises(ValueError, match="n_group"):
        MoEConfig(num_experts=6, top_k=2, expert_mlp_dim=4, n_group=4)
    with pytest.raises(ValueError, match="score_func"):
        MoEConfig(num_experts=8, top_k=2, expert_mlp_dim=4, score_func="relu")
    with pytest.raises(ValueError, match="topk_group"):
        MoEConfig(num_experts=8, top_k=4, expert_mlp_dim=4, n_group=4, topk_group=1)
    config = MoEConfig(num_experts=6, top_k=2, expert_mlp_dim=4)
    params = init_moe_params(config, D, jax.random.key(0))
    mesh = make_mesh(MeshConfig.from_dict({"expert": 4, "fsdp": 2}), devices)
    with pytest.raises(ValueError, match="num_experts=6 must be a multiple"):
        jax.jit(lambda p, x: moe_forward(p, x, config, mesh=mesh))(params, _x(B=8))


def test_update_routing_bias_moves_toward_balance():
    bias = update_routing_bias(jnp.zeros(4), jnp.asarray([8, 2, 5, 5]), 0.001)
    np.testing.assert_allclose(np.asarray(bias), [-0.001, 0.001, 0.0, 0.0], rtol=1e-6)
