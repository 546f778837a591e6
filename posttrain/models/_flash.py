"""Memory-bounded attention in plain JAX: queries in blocks, keys in blocks, online softmax.

`flash_attention` never holds more than one `[block_q, block_k]` tile of scores per (batch,
head): a `lax.map` over query blocks, each a `lax.scan` over key blocks that carries the running
maximum, normaliser and weighted values (FlashAttention's recurrence). Both bodies are
rematerialised, so the backward pass recomputes a query block's tiles instead of storing them:
activation memory grows linearly with the length, as the fused kernels' does, on any backend
(`model.attention="flash"`; the CPU and GPU fallback for long rows). Key blocks that no query of
the block can see (after it causally, outside the window, other documents) are skipped.

`block_attention` is one tile's partial result with its log-normaliser, `merge_partials`
combines partials over disjoint key sets, and `block_terms` is a tile's share of attention
normalised over all keys, whose VJP is that tile's part of the gradient: the pieces ring
attention (context parallelism) runs per rotation step, forward and backward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Added to (or put in place of) masked scores: exp() of it is 0, yet adding it to a score never
# overflows.
_MASKED = -1e30


def attention_mask(
    q_positions_BL, kv_positions_BS, q_segment_ids_BL, kv_segment_ids_BS, window: int = 0,
    q_blocks_BL=None, kv_blocks_BS=None,
):  # fmt: skip
    """Boolean `[B, L, S]`: same document, causal by position, inside the window if any.
    With blocks (ids > 0: one image's tokens, `posttrain.models._vision.image_blocks`), a
    query also sees the later keys of its own block (Gemma 3's bidirectional images)."""
    q_pos, kv_pos = q_positions_BL[:, :, None], kv_positions_BS[:, None, :]
    causal = kv_pos <= q_pos
    if q_blocks_BL is not None:
        q_block = q_blocks_BL[:, :, None]
        causal |= (q_block > 0) & (q_block == kv_blocks_BS[:, None, :])
    mask = causal & (q_segment_ids_BL[:, :, None] == kv_segment_ids_BS[:, None, :])
    if window:
        mask &= q_pos - kv_pos < window
    return mask


def _scores(q_BLNH, k_BSKH, mask_BLS, scale, softcap=0.0):
    """Scores `[B, K, G, L, S]` float32 of each kv head's G query heads (soft-capped when
    `softcap` > 0), `_MASKED` where the mask hides the key."""
    B, L, N, H = q_BLNH.shape
    K = k_BSKH.shape[2]
    q_BKGLH = q_BLNH.reshape(B, L, K, N // K, H).transpose(0, 2, 3, 1, 4)
    s_BKGLS = jnp.einsum("BKGLH,BSKH->BKGLS", q_BKGLH, k_BSKH, preferred_element_type=jnp.float32)
    s_BKGLS = s_BKGLS * scale
    if softcap:
        s_BKGLS = softcap * jnp.tanh(s_BKGLS / softcap)
    return jnp.where(mask_BLS[:, None, None], s_BKGLS, _MASKED)


def _weighted_values(p_BKGLS, v_BSKH):
    """`sum_j p_ij v_j` as `[B, L, N, Hv]` float32."""
    o_BKGLV = jnp.einsum(
        "BKGLS,BSKV->BKGLV", p_BKGLS.astype(v_BSKH.dtype), v_BSKH,
        preferred_element_type=jnp.float32,
    )  # fmt: skip
    B, K, G, L, Hv = o_BKGLV.shape
    return o_BKGLV.transpose(0, 3, 1, 2, 4).reshape(B, L, K * G, Hv)


def _per_query(x_BKGL):
    B, K, G, L = x_BKGL.shape
    return x_BKGL.transpose(0, 3, 1, 2).reshape(B, L, K * G)


def block_attention(q_BLNH, k_BSKH, v_BSKH, mask_BLS, *, scale, softcap=0.0):
    """Attention of the queries over these keys only: `(out [B, L, N, Hv] float32, lse [B, L, N])`
    with lse the log of the softmax normaliser over the visible keys (`_MASKED` where a query
    sees none of them, out 0 there)."""
    s_BKGLS = _scores(q_BLNH, k_BSKH, mask_BLS, scale, softcap)
    m_BKGL = jnp.max(s_BKGLS, axis=-1)
    p_BKGLS = jnp.where(mask_BLS[:, None, None], jnp.exp(s_BKGLS - m_BKGL[..., None]), 0.0)
    l_BKGL = jnp.sum(p_BKGLS, axis=-1)
    seen = l_BKGL > 0
    lse_BKGL = jnp.where(seen, m_BKGL + jnp.log(jnp.where(seen, l_BKGL, 1.0)), _MASKED)
    out = _weighted_values(p_BKGLS, v_BSKH) / _per_query(jnp.where(seen, l_BKGL, 1.0))[..., None]
    return out, _per_query(lse_BKGL)


def block_terms(q_BLNH, k_BSKH, v_BSKH, mask_BLS, lse_BLN, *, scale):
    """These keys' share of attention normalised over more keys (`lse_BLN`: the log-normaliser
    over all of them): `(sum_j p_ij v_j, sum_j p_ij)` with `p_ij = exp(s_ij - lse_i)`.

    Their VJP with cotangents `(dO, -rowsum(dO * O))` (O the whole attention's output) is
    these keys' part of attention's gradient (FlashAttention-2's `dS = P (dP - D)`): what ring
    attention's backward pass computes at each hop."""
    s_BKGLS = _scores(q_BLNH, k_BSKH, mask_BLS, scale)
    B, L, N = lse_BLN.shape
    K = k_BSKH.shape[2]
    lse_BKGL = lse_BLN.reshape(B, L, K, N // K).transpose(0, 2, 3, 1)
    p_BKGLS = jnp.where(mask_BLS[:, None, None], jnp.exp(s_BKGLS - lse_BKGL[..., None]), 0.0)
    return _weighted_values(p_BKGLS, v_BSKH), _per_query(jnp.sum(p_BKGLS, axis=-1))


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Two partial attentions of the same queries over disjoint keys, as one."""
    lse = jnp.maximum(lse_a, lse_b)
    lse = lse + jnp.log(jnp.exp(lse_a - lse) + jnp.exp(lse_b - lse))
    lse = jnp.where((lse_a <= _MASKED) & (lse_b <= _MASKED), _MASKED, lse)
    w_a, w_b = jnp.exp(lse_a - lse)[..., None], jnp.exp(lse_b - lse)[..., None]
    return out_a * w_a + out_b * w_b, lse


def _blocks(x, size: int, fill):
    """`[B, L, ...]` -> `[L / size, B, size, ...]`, padding L with `fill`."""
    B, L = x.shape[:2]
    n = -(-L // size)
    x = jnp.pad(x, [(0, 0), (0, n * size - L)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return jnp.moveaxis(x.reshape(B, n, size, *x.shape[2:]), 1, 0)


def flash_attention(q_BLNH, k_BSKH, v_BSKH, q_pos, kv_pos, q_seg, kv_seg, window: int, *,
                    scale: float, softcap: float = 0.0, block_q: int = 512,
                    block_k: int = 512):  # fmt: skip
    """Causal attention by position with packing and windows (as `attention(impl="xla")`), in
    query and key blocks with rematerialised bodies; `[B, L, N, Hv]` in q's dtype."""
    args = (q_pos, kv_pos, q_seg, kv_seg, window)
    out, _ = flash_partial(q_BLNH, k_BSKH, v_BSKH, *args, scale=scale, softcap=softcap,
                           block_q=block_q, block_k=block_k)  # fmt: skip
    return out.astype(q_BLNH.dtype)


def flash_partial(q_BLNH, k_BSKH, v_BSKH, q_pos, kv_pos, q_seg, kv_seg, window: int, *,
                  scale: float, softcap: float = 0.0, block_q: int = 512,
                  block_k: int = 512):  # fmt: skip
    """`flash_attention` as a partial result over these keys: `(out float32, lse)` as
    `block_attention` returns them, for `merge_partials` with other keys' (ring attention)."""
    B, _, N, _ = q_BLNH.shape
    Hv = v_BSKH.shape[3]

    def tile(carry, q, k, v, mask, _):
        return merge_partials(*carry, *block_attention(q, k, v, mask, scale=scale, softcap=softcap))

    init = lambda bq: (jnp.zeros((B, bq, N, Hv), jnp.float32), jnp.full((B, bq, N), _MASKED))  # noqa: E731
    args = (q_BLNH, k_BSKH, v_BSKH, q_pos, kv_pos, q_seg, kv_seg, window, block_q, block_k)
    return _blockwise(tile, init, *args)


def flash_terms(q_BLNH, k_BSKH, v_BSKH, q_pos, kv_pos, q_seg, kv_seg, lse_BLN, window: int, *,
                scale: float, block_q: int = 512, block_k: int = 512):  # fmt: skip
    """`block_terms` over these keys, in blocks as `flash_partial`."""
    B, _, N, _ = q_BLNH.shape
    Hv = v_BSKH.shape[3]

    def tile(carry, q, k, v, mask, lse):
        terms = block_terms(q, k, v, mask, lse, scale=scale)
        return tuple(a + b for a, b in zip(carry, terms, strict=True))

    init = lambda bq: (jnp.zeros((B, bq, N, Hv), jnp.float32), jnp.zeros((B, bq, N)))  # noqa: E731
    args = (q_BLNH, k_BSKH, v_BSKH, q_pos, kv_pos, q_seg, kv_seg, window, block_q, block_k)
    return _blockwise(tile, init, *args, per_query=lse_BLN)


def _blockwise(tile, init, q_BLNH, k_BSKH, v_BSKH, q_pos, kv_pos, q_seg, kv_seg, window,
               block_q, block_k, per_query=None):  # fmt: skip
    """Folds `tile(carry, q, k, v, mask, per_query)` over the key blocks each query block can
    see, from `init(block rows)`; a `lax.map` over query blocks of a `lax.scan` over key blocks,
    both rematerialised. Returns the carries, `[B, L, ...]` each."""
    B, L = q_BLNH.shape[:2]
    bq, bk = min(block_q, L), min(block_k, k_BSKH.shape[1])
    # Padded queries and keys belong to no document (ids -1, -2): they see and are seen by
    # nothing, and the padded outputs are cut off.
    ks = (_blocks(k_BSKH, bk, 0), _blocks(v_BSKH, bk, 0))
    ks += (_blocks(kv_pos, bk, 0), _blocks(kv_seg, bk, -2))

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def query_block(xs):
        q, pos, seg, extra = xs

        @functools.partial(jax.checkpoint, prevent_cse=False)
        def key_block(carry, kv):
            k, v, k_pos, k_seg = kv
            mask = attention_mask(pos, k_pos, seg, k_seg, window)
            fold = lambda c: tile(c, q, k, v, mask, extra)  # noqa: E731
            return jax.lax.cond(jnp.any(mask), fold, lambda c: c, carry), None

        return jax.lax.scan(key_block, init(bq), ks)[0]

    extra = None if per_query is None else _blocks(per_query, bq, 0)
    qs = (_blocks(q_BLNH, bq, 0), _blocks(q_pos, bq, 0), _blocks(q_seg, bq, -1), extra)
    carries = jax.lax.map(query_block, qs)
    return tuple(jnp.moveaxis(c, 0, 1).reshape(B, -1, *c.shape[3:])[:, :L] for c in carries)
