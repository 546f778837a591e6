"""Batch-invariant decoding (`ModelConfig.batch_invariant`): every per-token number the same,
bitwise, whether a token is computed in the trainer's `[B, L]` pass, a prefill or a decode step.

XLA:CPU (like GPU and TPU kernels) picks its loop nest, vectorisation and matmul blocking from
an op's shapes, so the same row gives different bits in a `[1, D]` decode step and a
`[B * L, D]` training pass: a `[M, K] @ [K, N]` row differs between M = 1 and M = 1024, a
softmax over 16 keys between 1 and 100 rows (measured; see docs/rl.md). This mode fixes the
decomposition instead of the shapes:

- Per-token steps run in tiles of `TILE` rows (`rows`: padded, `lax.map` over
  `[TILE, ...]` tiles): the pre-attention block (norm, q/k/v, qk-norm, RoPE), the
  post-attention block (output projection, residual, norm, MLP or router, expert combine),
  the final norm, the lm_head and the log-softmax are one compiled tile body each, whatever
  the number of tokens.
- Attention (`attention_rows`) runs per row and query tile over keys in blocks of `TILE`,
  folded in order 0, 1, 2, ... with an online softmax. A block past a query's position is
  fully masked and leaves the running sums exactly as they were, so a training row of length
  L and a decode step over a paged pool of any number of blocks give the same bits.
- MoE experts (`grouped_experts`) run on tiles that each hold `TILE` assignments of one
  expert (sorted by expert, each group padded to whole tiles): a token's expert output does
  not depend on which other tokens chose that expert.

It costs padding (a decode step fills one row of a 16-row tile), the sequential key blocks
and the per-tile loops; `benchmarks/zero_mismatch.py` measures it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from posttrain.models._flash import _MASKED
from posttrain.models._moe import route
from posttrain.models._ops import dense, rms_norm
from posttrain.models._rope import apply_rope
from posttrain.parallel import logical_to_spec

TILE = 16  # rows per tile and keys per attention block (a multiple of the vector width)


def rows(fn, *xs_M, tile: int = TILE):
    """`fn` over tiles of `tile` rows of the `xs_M` (same leading M, padded with zeros); its
    outputs (a pytree of `[tile, ...]` arrays) as `[M, ...]`. On a mesh each device tiles its
    own rows (`per_shard`)."""

    def local(*xs_m):
        m = xs_m[0].shape[0]
        n = max(-(-m // tile), 1)

        def split(x):
            x = jnp.pad(x, [(0, n * tile - m)] + [(0, 0)] * (x.ndim - 1))
            return x.reshape(n, tile, *x.shape[1:])

        out = jax.lax.map(lambda xs: fn(*xs), tuple(split(x) for x in xs_m))
        return jax.tree.map(lambda y: y.reshape(n * tile, *y.shape[2:])[:m], out)

    return per_shard(local, *xs_M)


def per_shard(fn, *xs_M):
    """`fn` of each device's own rows: the `xs_M` (same leading M) as `[S, M / S, ...]` with S
    split over the enclosing mesh's batch axes (`act_batch`; S = 1 off a mesh or when they do
    not divide M), `fn` vmapped over S; its outputs back as `[M, ...]`.

    Tiled globally, tiles that S does not divide leave the partitioner free to split one
    tile's rows across devices, and a reduction split that way sums in another order: an
    engine's 8 replicated slots on a 4-device data mesh took the log-softmax of `[2, V]`
    blocks, one float32 ulp from the trainer's `[16, V]` tiles (measured)."""
    M = xs_M[0].shape[0]
    S, spec = 1, None
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        spec = logical_to_spec(("act_batch",), (M,), mesh)
        axes = spec[0] if spec else None
        axes = (axes,) if isinstance(axes, str) else axes or ()
        S = math.prod(dict(mesh.shape)[a] for a in axes)
    xs = tuple(x.reshape(S, M // S, *x.shape[1:]) for x in xs_M)
    if S > 1:
        xs = jax.lax.with_sharding_constraint(xs, spec)
    return jax.tree.map(lambda y: y.reshape(M, *y.shape[2:]), jax.vmap(fn)(*xs))


def norm_rows(x_BLD, scale_D, eps: float):
    """`rms_norm` in row tiles."""
    B, L, D = x_BLD.shape
    return rows(lambda x: rms_norm(x, scale_D, eps), x_BLD.reshape(B * L, D)).reshape(B, L, D)


def logits_rows(hidden_BLD, head_DV):
    """`hidden @ head` in float32, in row tiles: `[B, L, V]`."""
    B, L, D = hidden_BLD.shape
    logits = rows(
        lambda h: dense(h, head_DV, preferred_element_type=jnp.float32),
        hidden_BLD.reshape(B * L, D),
    )
    return logits.reshape(B, L, -1)


def token_logprobs(logits_BLV, targets_BL):
    """`logits[target] - logsumexp(logits)` (float32 `[B, L]`) in row tiles: the one formula the
    sampler and the trainer both use in this mode."""
    B, L, V = logits_BLV.shape

    def tile(logits_tV, targets_t):
        logits_tV = logits_tV.astype(jnp.float32)
        target_t = jnp.take_along_axis(logits_tV, targets_t[:, None], axis=-1)[:, 0]
        return target_t - jax.nn.logsumexp(logits_tV, axis=-1)

    logp = rows(tile, logits_BLV.reshape(B * L, V), targets_BL.reshape(B * L))
    return logp.reshape(B, L)


def attention_rows(
    q_BLNH, k_BSKH, v_BSKH, q_pos_BL, kv_pos_BS, q_seg_BL, kv_seg_BS, window, *, scale: float
):
    """Causal attention by position and segment id (as `attention(impl="xla")`), per row and
    tile of `TILE` queries, over key blocks of `TILE` folded in order (see the module
    docstring); `window` (0: none) may be traced. `[B, L, N, Hv]` in q's dtype.

    Segment id 0 is padding (the convention of every caller): its queries see nothing and come
    out 0, so a query tile of padding, and a key block no query of the tile sees, are skipped
    (folding it would leave the running sums exactly as they are)."""
    B, L, N, H = q_BLNH.shape
    S, K, Hv = k_BSKH.shape[1], k_BSKH.shape[2], v_BSKH.shape[3]
    G, t = N // K, TILE
    nq, nk = -(-L // t), -(-S // t)

    def blocks(x, n, fill):  # [L, ...] -> [n, t, ...], padded with `fill`
        x = jnp.pad(x, [(0, n * t - x.shape[0])] + [(0, 0)] * (x.ndim - 1), constant_values=fill)
        return x.reshape(n, t, *x.shape[1:])

    def query_tile(keys, xs):
        q_tNH, q_pos_t, q_seg_t = xs
        q_KGtH = q_tNH.reshape(t, K, G, H).transpose(1, 2, 0, 3)

        def key_block(carry, kv):
            k_bKH, v_bKV, kv_pos_b, kv_seg_b = kv
            mask_tb = (kv_pos_b[None] <= q_pos_t[:, None]) & (kv_seg_b[None] == q_seg_t[:, None])
            mask_tb &= (q_seg_t != 0)[:, None]
            in_window = (q_pos_t[:, None] - kv_pos_b[None]) < window
            mask_tb &= (window <= 0) | in_window
            fold = lambda c: fold_block(c, k_bKH, v_bKV, mask_tb)  # noqa: E731
            return jax.lax.cond(jnp.any(mask_tb), fold, lambda c: c, carry), None

        def fold_block(carry, k_bKH, v_bKV, mask_tb):
            m_KGt, l_KGt, acc_KGtV = carry
            s_KGtb = jnp.einsum("KGtH,bKH->KGtb", q_KGtH, k_bKH, preferred_element_type=jnp.float32)
            s_KGtb = jnp.where(mask_tb, s_KGtb * scale, _MASKED)
            m_new = jnp.maximum(m_KGt, jnp.max(s_KGtb, axis=-1))
            alpha = jnp.exp(m_KGt - m_new)  # 1 exactly when this block changes nothing
            p_KGtb = jnp.where(mask_tb, jnp.exp(s_KGtb - m_new[..., None]), 0.0)
            pv_KGtV = jnp.einsum(
                "KGtb,bKV->KGtV", p_KGtb.astype(v_bKV.dtype), v_bKV,
                preferred_element_type=jnp.float32,
            )  # fmt: skip
            return (
                m_new,
                alpha * l_KGt + jnp.sum(p_KGtb, axis=-1),
                alpha[..., None] * acc_KGtV + pv_KGtV,
            )

        init = (
            jnp.full((K, G, t), _MASKED, jnp.float32),
            jnp.zeros((K, G, t), jnp.float32),
            jnp.zeros((K, G, t, Hv), jnp.float32),
        )
        (_, l_KGt, acc_KGtV), _ = jax.lax.scan(key_block, init, keys)
        out_KGtV = acc_KGtV / jnp.where(l_KGt > 0, l_KGt, 1.0)[..., None]
        return out_KGtV.transpose(2, 0, 1, 3).reshape(t, N, Hv).astype(q_BLNH.dtype)

    def real_query_tile(keys, xs):
        empty = jnp.zeros((t, N, Hv), q_BLNH.dtype)
        return jax.lax.cond(jnp.any(xs[2] != 0), query_tile, lambda *_: empty, keys, xs)

    def row(xs):
        q_LNH, q_pos_L, q_seg_L, k_SKH, v_SKV, kv_pos_S, kv_seg_S = xs
        keys = (blocks(k_SKH, nk, 0), blocks(v_SKV, nk, 0))
        keys += (blocks(kv_pos_S, nk, 0), blocks(kv_seg_S, nk, 0))
        queries = (blocks(q_LNH, nq, 0), blocks(q_pos_L, nq, 0), blocks(q_seg_L, nq, 0))
        out = jax.lax.map(lambda qs: real_query_tile(keys, qs), queries)
        return out.reshape(nq * t, N, Hv)[:L]

    xs = (q_BLNH, q_pos_BL, q_seg_BL, k_BSKH, v_BSKH, kv_pos_BS, kv_seg_BS)
    return per_shard(lambda *xs: jax.lax.map(row, xs), *xs)  # each device its own rows


def grouped_experts(x_MD, experts_MK, gate_EDF, up_EDF, down_EFD):
    """Each token's K routed SwiGLU experts `[M, K, D]`, computed on tiles of `TILE` assignments
    of one expert (the assignments sorted by expert, each expert's padded to whole tiles)."""
    M, K = experts_MK.shape
    E, D = gate_EDF.shape[0], x_MD.shape[1]
    A, t = M * K, TILE
    flat_A = experts_MK.reshape(-1)
    order_A = jnp.argsort(flat_A, stable=True)
    expert_A = flat_A[order_A]
    sizes_E = jnp.bincount(flat_A, length=E)
    padded_E = -(-sizes_E // t) * t
    ends_E = jnp.cumsum(padded_E)
    slot_A = (
        ends_E[expert_A]
        - padded_E[expert_A]
        + jnp.arange(A)
        - (jnp.cumsum(sizes_E) - sizes_E)[expert_A]
    )
    n = -(-A // t) + E  # enough tiles for any routing
    x_nD = jnp.zeros((n * t, D), x_MD.dtype).at[slot_A].set(x_MD[order_A // K])
    tile_expert_n = jnp.minimum(jnp.searchsorted(ends_E, jnp.arange(n) * t, side="right"), E - 1)

    def tile(xs):
        x_tD, e = xs
        h_tF = jax.nn.silu(dense(x_tD, gate_EDF[e])) * dense(x_tD, up_EDF[e])
        return dense(h_tF, down_EFD[e])

    out_nD = jax.lax.map(tile, (x_nD.reshape(n, t, D), tile_expert_n)).reshape(n * t, D)
    out_AD = jnp.zeros((A, D), out_nD.dtype).at[order_A].set(out_nD[slot_A])
    return out_AD.reshape(M, K, D)


def invariant_layer(
    x_BLD,
    p,
    window,
    k_cache_BSKH,
    v_cache_BSKH,
    replay_BLK=None,
    *,
    config,
    cos,
    sin,
    positions_BL,
    segment_ids_BL,
    kv_positions_BS=None,
    kv_segment_ids_BS=None,
    cache_update=None,
):
    """One decoder block as `_block._layer` computes it (same params, cache and aux),
    with every per-token step in row tiles and attention in ordered key blocks; `window` is
    this layer's (0: full). Returns `(x, (cache, aux))`."""
    B, L, D = x_BLD.shape
    M, dt, eps = B * L, config.dtype, config.norm_eps
    a, N, K, H = p["attn"], config.num_heads, config.num_kv_heads, config.head_dim

    def pre(x_tD, cos_th, sin_th):
        h_tD = rms_norm(x_tD, p["attn_norm"], eps)
        q, k, v = (dense(h_tD, a[n].astype(dt)) for n in ("q", "k", "v"))
        if config.qkv_bias:
            q, k, v = (y + a[f"{n}_bias"].astype(dt) for y, n in zip((q, k, v), "qkv", strict=True))
        if config.qk_norm:
            q, k = rms_norm(q, a["q_norm"], eps), rms_norm(k, a["k_norm"], eps)
        q, k = (apply_rope(y[None], cos_th[None], sin_th[None])[0] for y in (q, k))
        return q, k, v

    flat = lambda y: y.reshape(M, *y.shape[2:])  # noqa: E731
    q, k, v = rows(pre, flat(x_BLD), flat(cos), flat(sin))
    q_BLNH, k_BLKH, v_BLKH = q.reshape(B, L, N, H), k.reshape(B, L, K, H), v.reshape(B, L, K, H)
    new_cache = None
    if k_cache_BSKH is None:
        kv_positions_BS, kv_segment_ids_BS = positions_BL, segment_ids_BL
    elif v_cache_BSKH is None:  # a combined pool
        k_store, (k_BLKH, v_BLKH) = cache_update(k_cache_BSKH, (k_BLKH, v_BLKH))
        new_cache = (k_store, None)
    else:
        k_store, k_BLKH = cache_update(k_cache_BSKH, k_BLKH)
        v_store, v_BLKH = cache_update(v_cache_BSKH, v_BLKH)
        new_cache = (k_store, v_store)
    o_BLNH = attention_rows(
        q_BLNH, k_BLKH, v_BLKH, positions_BL, kv_positions_BS, segment_ids_BL, kv_segment_ids_BS,
        window, scale=H**-0.5,
    )  # fmt: skip

    def post(x_tD, o_tNH):
        x_tD = x_tD + dense(o_tNH, a["o"].astype(dt), contract=2)
        if config.o_bias:
            x_tD += a["o_bias"].astype(dt)
        return x_tD, rms_norm(x_tD, p["mlp_norm"], eps)

    x_MD, h_MD = rows(post, flat(x_BLD), flat(o_BLNH))
    aux = {}
    if "moe" in p:
        y_MD, aux = _experts(p["moe"], h_MD, config.moe, segment_ids_BL, replay_BLK, dt)
        aux["routed_experts"] = aux["routed_experts"].reshape(B, L, -1)
        x_MD = rows(lambda x, y: x + y, x_MD, y_MD)
    else:
        m = p["mlp"]

        def mlp(x_tD, h_tD):
            act = jax.nn.silu(dense(h_tD, m["gate"].astype(dt))) * dense(h_tD, m["up"].astype(dt))
            return x_tD + dense(act, m["down"].astype(dt))

        x_MD = rows(mlp, x_MD, h_MD)
    return x_MD.reshape(B, L, D), (new_cache, aux)


def _experts(params, h_MD, c, segment_ids_BL, replay_BLK, dt):
    """The MoE feed-forward of normed tokens `h_MD` with tiled routing and expert tiles, and the
    aux outputs of `moe_forward` (losses and counts from the router over all tokens at once;
    `routed_experts` the experts used)."""
    if c.dispatch != "dropless":
        raise ValueError("batch_invariant runs MoE layers dropless; set moe.dispatch='dropless'")
    M = h_MD.shape[0]
    replay_MK = None if replay_BLK is None else replay_BLK.reshape(M, -1)
    mask_M = (segment_ids_BL != 0).reshape(M)
    _, _, aux = route(params, h_MD, c, mask_M, replay_MK)
    if replay_MK is None:
        experts_MK, weights_MK = rows(lambda h: route(params, h, c)[:2], h_MD)
    else:
        choose = lambda h, r: route(params, h, c, None, r)[:2]  # noqa: E731
        experts_MK, weights_MK = rows(choose, h_MD, replay_MK)
    ex = {k: w.astype(dt) for k, w in params["experts"].items()}
    group = lambda x, e: grouped_experts(x, e, ex["gate"], ex["up"], ex["down"])  # noqa: E731
    out_MKD = per_shard(group, h_MD, experts_MK)  # each device groups its own tokens

    def combine(out_tKD, weights_tK, h_tD):
        y = jnp.einsum("tKD,tK->tD", out_tKD.astype(jnp.float32), weights_tK).astype(dt)
        if c.num_shared_experts:
            s = {k: w.astype(dt) for k, w in params["shared"].items()}
            y = y + dense(jax.nn.silu(dense(h_tD, s["gate"])) * dense(h_tD, s["up"]), s["down"])
        return y

    aux = {**aux, "routed_experts": experts_MK, "dropped_fraction": jnp.zeros((), jnp.float32)}
    return rows(combine, out_MKD, weights_MK, h_MD), aux
