"""Mixture-of-experts feed-forward: a router, routed SwiGLU experts and optional shared experts.

Covers Qwen3-MoE (softmax top-k, optional renormalisation) and DeepSeek-V3 / Kimi K2 (sigmoid
scores, group-limited routing, an aux-loss-free selection bias, a routed scaling factor and
shared experts). Pure functions over a params dict declared by `moe_param_specs`.

Shape suffixes follow DESIGN.md, plus three local keys: `M` tokens (B*L flattened), `K` the
top-k choices of a token (not kv heads here), `C` slots per expert (capacity) or per
destination device (expert parallelism).

Dispatch:
- "dropless": assignments sorted by expert and run with `jax.lax.ragged_dot` (no token dropped).
  Under a mesh the experts run inside `jax.shard_map`; when the rules shard the experts' leading
  dimension (`experts` -> `expert` by default) each device sends its tokens to the devices that
  own their experts with two fixed-size `jax.lax.all_to_all`s (see `ep_capacity_factor`).
- "capacity": GShard one-hot dispatch/combine einsums with C = ceil(factor * M * K / E) slots per
  expert; assignments past an expert's capacity are dropped (counted in `dropped_fraction`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from posttrain.models._components import MoEConfig
from posttrain.models._ops import ParamSpec, dense
from posttrain.parallel import constrain, logical_to_spec


def moe_param_specs(config: MoEConfig, embed_dim: int, num_layers: int | None = None) -> dict:
    """Shapes and logical axes of the layer's weights; with `num_layers`, a leading `layers` T."""
    E, F, D = config.num_experts, config.expert_mlp_dim, embed_dim
    lead, lead_axes = ((num_layers,), ("layers",)) if num_layers is not None else ((), ())

    def spec(shape, axes, init="normal"):
        return ParamSpec(lead + shape, lead_axes + axes, init)

    specs = {
        "router": spec((D, E), ("embed", None)),
        "experts": {
            "gate": spec((E, D, F), ("experts", "embed", "mlp")),
            "up": spec((E, D, F), ("experts", "embed", "mlp")),
            "down": spec((E, F, D), ("experts", "mlp", "embed")),
        },
    }
    if config.use_routing_bias:
        specs["routing_bias"] = spec((E,), (None,), "zeros")
    if config.num_shared_experts:
        Fs = F * config.num_shared_experts
        specs["shared"] = {
            "gate": spec((D, Fs), ("embed", "mlp")),
            "up": spec((D, Fs), ("embed", "mlp")),
            "down": spec((Fs, D), ("mlp", "embed")),
        }
    return specs


def init_moe_params(config: MoEConfig, embed_dim: int, rng: jax.Array, dtype=jnp.float32) -> dict:
    """Random weights (normal, std 0.02; the routing bias zero), unsharded: for tests."""
    specs = moe_param_specs(config, embed_dim)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=lambda x: isinstance(x, ParamSpec))
    keys = jax.random.split(rng, len(leaves))
    out = [
        jnp.zeros(s.shape, dtype)
        if s.init == "zeros"
        else (0.02 * jax.random.normal(k, s.shape, jnp.float32)).astype(dtype)
        for k, s in zip(keys, leaves, strict=True)
    ]
    return jax.tree.unflatten(treedef, out)


def route(params: dict, x_MD: jax.Array, config: MoEConfig, token_mask_M=None, replay_MK=None):
    """Chooses each token's experts and weights; all router math in float32.

    Args:
      params: the layer's params (`router`, optionally `routing_bias`).
      x_MD: the tokens.
      config: the layer.
      token_mask_M: 1 for real tokens; padding is left out of the losses and counts.
      replay_MK: router replay: expert ids to use instead of the router's own top-k (a token
        whose first id is < 0 keeps its own). The weights are still the router's current
        scores at those experts (normalised and scaled as configured), so the router gets
        its usual gradient; only the selection (top-k, routing bias, group limit) is replaced.

    Returns:
      `(experts_MK, weights_MK, aux)`: int32 expert ids, float32 weights (normalised and scaled
      as configured) and the `aux` dict of `moe_forward` without `dropped_fraction`.
    """
    c = config
    E, K = c.num_experts, c.top_k
    logits_ME = jnp.dot(x_MD.astype(jnp.float32), params["router"].astype(jnp.float32))
    if c.score_func == "softmax":
        scores_ME = jax.nn.softmax(logits_ME, axis=-1)
    else:
        scores_ME = jax.nn.sigmoid(logits_ME)
    choice_ME = jax.lax.stop_gradient(scores_ME)
    if c.use_routing_bias:
        choice_ME = choice_ME + jax.lax.stop_gradient(params["routing_bias"].astype(jnp.float32))
    if c.n_group > 1:
        per_group = E // c.n_group
        grouped = choice_ME.reshape(-1, c.n_group, per_group)
        group_scores = jax.lax.top_k(grouped, min(2, per_group))[0].sum(-1)
        _, keep_groups = jax.lax.top_k(group_scores, c.topk_group)
        group_mask = jax.nn.one_hot(keep_groups, c.n_group, dtype=jnp.bool_).any(axis=-2)
        expert_mask_ME = jnp.repeat(group_mask, per_group, axis=-1)
        choice_ME = jnp.where(expert_mask_ME, choice_ME, -jnp.inf)
    _, chosen_MK = jax.lax.top_k(choice_ME, K)
    experts_MK = chosen_MK
    if replay_MK is not None:
        replay_MK = replay_MK.astype(chosen_MK.dtype)
        experts_MK = jnp.where(replay_MK[:, :1] >= 0, replay_MK, chosen_MK)
    weights_MK = jnp.take_along_axis(scores_ME, experts_MK, axis=-1)
    if c.norm_topk_prob:
        weights_MK = weights_MK / jnp.sum(weights_MK, axis=-1, keepdims=True)
    weights_MK = weights_MK * c.routed_scaling_factor

    mask_M = (
        jnp.ones(x_MD.shape[:1], jnp.float32)
        if token_mask_M is None
        else token_mask_M.astype(jnp.float32)
    )
    num_tokens = jnp.maximum(mask_M.sum(), 1.0)
    assigned_ME = jnp.sum(jax.nn.one_hot(experts_MK, E, dtype=jnp.float32), axis=1)
    counts_E = jnp.sum(assigned_ME * mask_M[:, None], axis=0)
    # Switch/GShard balance: E * sum_e f_e * P_e, with f_e the share of the M*K assignments and
    # P_e the mean router probability (sigmoid scores normalised per token); 1 when balanced.
    probs_ME = scores_ME / jnp.sum(scores_ME, axis=-1, keepdims=True)
    f_E = counts_E / (num_tokens * K)
    P_E = jnp.sum(probs_ME * mask_M[:, None], axis=0) / num_tokens
    aux_loss = E * jnp.sum(f_E * P_E)
    z_loss = jnp.sum(jax.nn.logsumexp(logits_ME, axis=-1) ** 2 * mask_M) / num_tokens
    aux = {
        "loss": c.aux_loss_coef * aux_loss + c.router_z_loss_coef * z_loss,
        "aux_loss": aux_loss,
        "z_loss": z_loss,
        "expert_counts": counts_E.astype(jnp.int32),
        "routed_experts": chosen_MK.astype(jnp.int32),  # the router's own top-k (replay or not)
    }
    return experts_MK.astype(jnp.int32), weights_MK, aux


def update_routing_bias(bias_E: jax.Array, expert_counts_E: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3 aux-loss-free balancing: raise the bias of under-loaded experts by `rate`,
    lower it for over-loaded ones (apply after each step, outside the optimizer)."""
    counts = expert_counts_E.astype(jnp.float32)
    mean = jnp.mean(counts, axis=-1, keepdims=True)
    return bias_E + rate * jnp.sign(mean - counts).astype(bias_E.dtype)


def _swiglu(x, gate, up, down):
    """Dense SwiGLU: `down(silu(x @ gate) * (x @ up))`."""
    return dense(jax.nn.silu(dense(x, gate)) * dense(x, up), down)


def _ragged_swiglu(x_RD, group_sizes_E, gate_EDF, up_EDF, down_EFD):
    """SwiGLU of rows sorted by expert; rows past `sum(group_sizes_E)` come out zero."""
    h_RF = jax.nn.silu(jax.lax.ragged_dot(x_RD, gate_EDF, group_sizes_E)) * jax.lax.ragged_dot(
        x_RD, up_EDF, group_sizes_E
    )
    return jax.lax.ragged_dot(h_RF, down_EFD, group_sizes_E)


def _dropless_local(x_MD, experts_MK, weights_MK, gate, up, down):
    """All experts on this device: sort the M*K assignments by expert, ragged matmuls, unsort.

    An expert id of E (padding) sorts last, outside every ragged group, and comes out zero.
    """
    M, K = experts_MK.shape
    E = gate.shape[0]
    flat_A = experts_MK.reshape(-1)
    order_A = jnp.argsort(flat_A, stable=True)
    group_sizes_E = jnp.bincount(flat_A, length=E).astype(jnp.int32)
    out_AD = _ragged_swiglu(x_MD[order_A // K], group_sizes_E, gate, up, down)
    out_MKD = jnp.zeros_like(out_AD).at[order_A].set(out_AD).reshape(M, K, -1)
    return _combine(out_MKD, weights_MK)


def _combine(out_MKD, weights_MK):
    """Weighted sum over each token's K experts, accumulated in float32."""
    y = jnp.einsum("MKD,MK->MD", out_MKD.astype(jnp.float32), weights_MK.astype(jnp.float32))
    return y.astype(out_MKD.dtype)


def _dropless_ep(x_MD, experts_MK, weights_MK, gate, up, down, *, axes, ep, capacity):
    """Inside shard_map: send assignments to their experts' devices, compute, send back.

    Each device fills one fixed buffer of `capacity` rows per destination (its assignments to
    that device's experts, in expert order); the rest of a buffer is padding with the sentinel
    local expert id E/ep, which sorts last and is outside every ragged group.
    """
    M, K = experts_MK.shape
    D = x_MD.shape[-1]
    E_loc = gate.shape[0]
    flat_A = experts_MK.reshape(-1)
    order_A = jnp.argsort(flat_A, stable=True)
    expert_A = flat_A[order_A]  # sorted by expert, hence by destination
    dest_A = expert_A // E_loc
    send_counts = jnp.bincount(dest_A, length=ep)
    pos_A = jnp.arange(M * K) - (jnp.cumsum(send_counts) - send_counts)[dest_A]
    real_A = dest_A < ep  # padding rows carry expert id E
    keep_A = (pos_A < capacity) & real_A
    slot_A = jnp.where(keep_A, dest_A * capacity + pos_A, ep * capacity)  # out of range: dropped
    x_send = (
        jnp.zeros((ep * capacity, D), x_MD.dtype).at[slot_A].set(x_MD[order_A // K], mode="drop")
    )
    e_send = (
        jnp.full((ep * capacity,), E_loc, jnp.int32).at[slot_A].set(expert_A % E_loc, mode="drop")
    )

    def exchange(buf):
        return jax.lax.all_to_all(
            buf.reshape(ep, capacity, *buf.shape[1:]), axes, 0, 0, tiled=True
        ).reshape(buf.shape)

    x_recv, e_recv = exchange(x_send), exchange(e_send)
    order_R = jnp.argsort(e_recv, stable=True)
    group_sizes = jnp.bincount(e_recv, length=E_loc).astype(jnp.int32)  # drops the sentinel
    out_sorted = _ragged_swiglu(x_recv[order_R], group_sizes, gate, up, down)
    out_back = exchange(jnp.zeros_like(out_sorted).at[order_R].set(out_sorted))
    out_A = jnp.where(keep_A[:, None], out_back.at[slot_A].get(mode="fill", fill_value=0), 0)
    out_MKD = jnp.zeros_like(out_A).at[order_A].set(out_A).reshape(M, K, D)
    dropped = jnp.sum(real_A & ~keep_A).astype(jnp.float32)
    return _combine(out_MKD, weights_MK), dropped


def _mesh_axes(logical, shape, mesh, dim: int) -> tuple[str, ...]:
    """The mesh axes that dimension `dim` of a `logical`-named array is split over."""
    spec = tuple(logical_to_spec(logical, shape, mesh))
    entry = spec[dim] if dim < len(spec) else None
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def expert_parallelism(mesh) -> int:
    """How many shards the routed experts are split over on `mesh` (1: none)."""
    return math.prod(dict(mesh.shape)[a] for a in _mesh_axes(("experts",), None, mesh, 0))


def _dropless_sharded(x_MD, experts_MK, weights_MK, experts, config, mesh):
    """The dropless experts under `jax.shard_map`, expert-parallel when the experts are sharded."""
    M = x_MD.shape[0]
    E, K = config.num_experts, config.top_k
    sizes = dict(mesh.shape)
    ep_axes = _mesh_axes(("experts",), None, mesh, 0)
    ep = math.prod(sizes[a] for a in ep_axes)
    if E % ep:
        raise ValueError(
            f"num_experts={E} must be a multiple of the {ep} devices on mesh axes {ep_axes} that "
            "shard the experts; change the mesh's expert axis or the `experts` rule"
        )
    tokens = ("act_batch", "act_length")
    batch_axes = _mesh_axes(tokens, None, mesh, 0) + _mesh_axes(tokens, None, mesh, 1)
    # Tokens split over every batch-like axis and the expert axes (so each expert-parallel rank
    # sends different tokens); x_MD is B-major, so (batch axes, length axes) keeps its layout.
    token_axes = tuple(dict.fromkeys(batch_axes + ep_axes))
    token_shards = math.prod(sizes[a] for a in token_axes)
    pad = -M % token_shards  # decoding steps may hold fewer tokens than devices
    if pad:  # padding rows choose the out-of-range expert E: no slot, no output
        x_MD = jnp.pad(x_MD, ((0, pad), (0, 0)))
        experts_MK = jnp.pad(experts_MK, ((0, pad), (0, 0)), constant_values=E)
        weights_MK = jnp.pad(weights_MK, ((0, pad), (0, 0)))
    f_axes = _mesh_axes((None, None, "mlp"), experts["gate"].shape, mesh, 2)
    if set(f_axes) & set(token_axes):  # F may only split where every rank holds the same tokens
        f_axes = ()
    ep_spec = ep_axes or None
    f_spec = f_axes or None
    w_in = jax.sharding.PartitionSpec(ep_spec, None, f_spec)
    w_out = jax.sharding.PartitionSpec(ep_spec, f_spec, None)
    tok = jax.sharding.PartitionSpec(token_axes or None)
    m = (M + pad) // token_shards
    worst = m * min(K, E // ep)
    if config.ep_capacity_factor is None or ep == 1:
        capacity = worst
    else:
        capacity = min(worst, math.ceil(config.ep_capacity_factor * m * K / ep))

    def body(x_MD, experts_MK, weights_MK, gate, up, down):
        if ep == 1:
            y_MD = _dropless_local(x_MD, experts_MK, weights_MK, gate, up, down)
            dropped = jnp.zeros((), jnp.float32)
        else:
            y_MD, dropped = _dropless_ep(
                x_MD, experts_MK, weights_MK, gate, up, down,
                axes=ep_axes if len(ep_axes) > 1 else ep_axes[0], ep=ep, capacity=capacity,
            )  # fmt: skip
        if f_axes:  # tensor-parallel experts: each device holds a slice of F
            y_MD = jax.lax.psum(y_MD, f_axes)
        if token_axes:
            dropped = jax.lax.psum(dropped, token_axes)
        return y_MD, dropped

    y_MD, dropped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(tok, tok, tok, w_in, w_in, w_out),
        out_specs=(tok, jax.sharding.PartitionSpec()),
    )(x_MD, experts_MK, weights_MK, experts["gate"], experts["up"], experts["down"])
    return y_MD[:M], dropped / (M * K)


def _capacity(x_MD, experts_MK, weights_MK, experts, config):
    """GShard dispatch: one-hot einsums into C slots per expert; first choices fill slots first."""
    M, K = experts_MK.shape
    E = config.num_experts
    C = math.ceil(config.capacity_factor * M * K / E)
    onehot_MKE = jax.nn.one_hot(experts_MK, E, dtype=jnp.int32)
    position_KME = jnp.cumsum(onehot_MKE.swapaxes(0, 1).reshape(K * M, E), axis=0) - 1
    position_MK = jnp.sum(position_KME.reshape(K, M, E).swapaxes(0, 1) * onehot_MKE, axis=-1)
    keep_MK = position_MK < C
    slot_MKC = jax.nn.one_hot(jnp.where(keep_MK, position_MK, C), C, dtype=jnp.float32)
    keep_MKE = onehot_MKE.astype(jnp.float32) * keep_MK[..., None]
    dispatch_MEC = jnp.einsum("MKE,MKC->MEC", keep_MKE, slot_MKC)
    combine_MEC = jnp.einsum("MKE,MKC->MEC", keep_MKE * weights_MK[..., None], slot_MKC)
    dt = x_MD.dtype
    in_ECD = jnp.einsum("MEC,MD->ECD", dispatch_MEC.astype(dt), x_MD)
    in_ECD = constrain(in_ECD, ("experts", None, "act_embed"))
    gate_ECF = jnp.einsum("ECD,EDF->ECF", in_ECD, experts["gate"])
    up_ECF = jnp.einsum("ECD,EDF->ECF", in_ECD, experts["up"])
    out_ECD = jnp.einsum("ECF,EFD->ECD", jax.nn.silu(gate_ECF) * up_ECF, experts["down"])
    out_ECD = constrain(out_ECD, ("experts", None, "act_embed"))
    y_MD = jnp.einsum("MEC,ECD->MD", combine_MEC, out_ECD.astype(jnp.float32)).astype(dt)
    return y_MD, 1.0 - jnp.mean(keep_MK.astype(jnp.float32))


def moe_forward(
    params: dict,
    x_BLD: jax.Array,
    config: MoEConfig,
    *,
    mesh=None,
    token_mask_BL: jax.Array | None = None,
    replay_BLK: jax.Array | None = None,
) -> tuple[jax.Array, dict]:
    """The MoE feed-forward of `x_BLD` (already normed), in `x_BLD.dtype`.

    Args:
      params: weights as declared by `moe_param_specs` (without the layers dimension).
      x_BLD: the layer input.
      config: the layer.
      mesh: the device mesh for the dropless experts (shard_map; expert-parallel when the
        `experts` rule shards the experts). Default: the mesh of the enclosing `jax.set_mesh`,
        else everything runs on one device.
      token_mask_BL: 1 for real tokens; padding still passes through the experts (and takes
        capacity) but is left out of the losses and expert counts.
      replay_BLK: router replay: each token's experts instead of the router's top-k (see
        `route`; a token whose first id is < 0 keeps its own).

    Returns:
      `(y_BLD, aux)` with float32 scalars `loss` (the coefficient-weighted sum to add to the
      objective), `aux_loss` (Switch balance, 1 when balanced), `z_loss` (mean squared router
      logsumexp) and `dropped_fraction` (share of the B*L*K assignments dropped, padding
      included), int32 `expert_counts [E]` (real tokens routed to each expert) and int32
      `routed_experts [B, L, K]` (the router's own top-k, whatever was replayed).
    """
    c = config
    B, L, D = x_BLD.shape
    x_MD = x_BLD.reshape(B * L, D)
    mask_M = None if token_mask_BL is None else token_mask_BL.reshape(B * L)
    replay_MK = None if replay_BLK is None else replay_BLK.reshape(B * L, -1)
    experts_MK, weights_MK, aux = route(params, x_MD, c, mask_M, replay_MK)
    aux["routed_experts"] = aux["routed_experts"].reshape(B, L, -1)
    dt = x_BLD.dtype
    experts = {k: v.astype(dt) for k, v in params["experts"].items()}
    if mesh is None:
        context = jax.sharding.get_abstract_mesh()
        mesh = None if context.empty else context
    if c.dispatch == "capacity":
        y_MD, dropped = _capacity(x_MD, experts_MK, weights_MK, experts, c)
    elif mesh is None:
        y_MD = _dropless_local(
            x_MD, experts_MK, weights_MK, experts["gate"], experts["up"], experts["down"]
        )
        dropped = jnp.zeros((), jnp.float32)
    else:
        y_MD, dropped = _dropless_sharded(x_MD, experts_MK, weights_MK, experts, c, mesh)
    if c.num_shared_experts:
        s = params["shared"]
        y_MD = y_MD + _swiglu(x_MD, s["gate"].astype(dt), s["up"].astype(dt), s["down"].astype(dt))
    aux["dropped_fraction"] = dropped
    return y_MD.reshape(B, L, D), aux


def moe_aux(aux_T: dict) -> dict:
    """The per-layer MoE outputs of a forward pass, reduced over layers: `loss` (to add to the
    objective), `aux_loss`, `z_loss`, `dropped_fraction` (layer means) and `expert_counts`
    `[T, E]` (real tokens routed to each expert of each MoE layer) and `routed_experts`
    `[B, L, T, K]` (each token's top-k of each MoE layer, as the router chose them). Empty for
    dense models."""
    if not aux_T:
        return {}
    out = {k: jnp.mean(aux_T[k]) for k in ("loss", "aux_loss", "z_loss", "dropped_fraction")}
    out["expert_counts"] = aux_T["expert_counts"]
    out["routed_experts"] = jnp.moveaxis(aux_T["routed_experts"], 0, 2)
    return out
