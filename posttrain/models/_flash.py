"""Memory-bounded attention in plain JAX: queries in blocks, keys in blocks, online softmax.

`flash_attention` never holds more than one `[block_q, block_k]` tile of scores per (batch,
head): a `lax.map` over query blocks, each a `lax.scan` over key blocks that carries the running
maximum, normaliser and weighted values (FlashAttention's recurrence). Both bodies are
rematerialised, so the backward pass recomputes a query block's tiles instead of storing them:
activation memory grows linearly with the length, as the fused kernels' does, on any backend
(`model.attention="flash"`; the CPU and GPU fallback for long rows). Key blocks that no query of
the block can see (after it causally, outside the window, other documents) are skipped.

`block_attention` is one tile's partial result with its log-normaliser, and `merge_partials`
combines partials over disjoint key sets: the pieces ring attention (context parallelism) runs
per rotation step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Added to (or put in place of) masked scores: exp() of it is 0, yet adding it to a score never
# overflows.
_MASKED = -1e30


def attention_mask(
    q_positions_BL, kv_positions_BS, q_segment_ids_BL, kv_segment_ids_BS, window: int = 0
):
    """Boolean `[B, L, S]`: same document, causal by position, inside the window if any."""
    q_pos, kv_pos = q_positions_BL[:, :, None], kv_positions_BS[:, None, :]
    mask = (kv_pos <= q_pos) & (q_segment_ids_BL[:, :, None] == kv_segment_ids_BS[:, None, :])
    if window:
        mask &= q_pos - kv_pos < window
    return mask


def block_attention(q_BLNH, k_BSKH, v_BSKH, mask_BLS, *, scale):
    """Attention of the queries over these keys only: `(out [B, L, N, Hv] float32, lse [B, L, N])`
    with lse the log of the softmax normaliser over the visible keys (`_MASKED` where a query
    sees none of them, out 0 there)."""
    B, L, N, H = q_BLNH.shape
    K, Hv = k_BSKH.shape[2], v_BSKH.shape[3]
    G = N // K
    q_BKGLH = q_BLNH.reshape(B, L, K, G, H).transpose(0, 2, 3, 1, 4)
    s_BKGLS = (
        jnp.einsum("BKGLH,BSKH->BKGLS", q_BKGLH, k_BSKH, preferred_element_type=jnp.float32) * scale
    )
    visible = mask_BLS[:, None, None]
    s_BKGLS = jnp.where(visible, s_BKGLS, _MASKED)
    m_BKGL = jnp.max(s_BKGLS, axis=-1)
    p_BKGLS = jnp.where(visible, jnp.exp(s_BKGLS - m_BKGL[..., None]), 0.0)
    l_BKGL = jnp.sum(p_BKGLS, axis=-1)
    o_BKGLV = jnp.einsum(
        "BKGLS,BSKV->BKGLV", p_BKGLS.astype(v_BSKH.dtype), v_BSKH,
        preferred_element_type=jnp.float32,
    )  # fmt: skip
    seen = l_BKGL > 0
    o_BKGLV = o_BKGLV / jnp.where(seen, l_BKGL, 1.0)[..., None]
    lse_BKGL = jnp.where(seen, m_BKGL + jnp.log(jnp.where(seen, l_BKGL, 1.0)), _MASKED)
    out = o_BKGLV.transpose(0, 3, 1, 2, 4).reshape(B, L, N, Hv)
    return out, lse_BKGL.transpose(0, 3, 1, 2).reshape(B, L, N)


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
                    scale: float, block_q: int = 512, block_k: int = 512):  # fmt: skip
    """Causal attention by position with packing and windows (as `attention(impl="xla")`), in
    query and key blocks with rematerialised bodies; `[B, L, N, Hv]` in q's dtype."""
    args = (q_pos, kv_pos, q_seg, kv_seg, window)
    out, _ = flash_partial(q_BLNH, k_BSKH, v_BSKH, *args, scale=scale, block_q=block_q,
                           block_k=block_k)  # fmt: skip
    return out.astype(q_BLNH.dtype)


def flash_partial(q_BLNH, k_BSKH, v_BSKH, q_pos, kv_pos, q_seg, kv_seg, window: int, *,
                  scale: float, block_q: int = 512, block_k: int = 512):  # fmt: skip
    """`flash_attention` as a partial result over these keys: `(out float32, lse)` as
    `block_attention` returns them, for `merge_partials` with other keys' (ring attention)."""
    B, L, N, _ = q_BLNH.shape
    S, Hv = k_BSKH.shape[1], v_BSKH.shape[3]
    bq, bk = min(block_q, L), min(block_k, S)
    # Padded queries and keys belong to no document (ids -1, -2): they see and are seen by
    # nothing, and the padded outputs are cut off.
    ks = (_blocks(k_BSKH, bk, 0), _blocks(v_BSKH, bk, 0))
    ks += (_blocks(kv_pos, bk, 0), _blocks(kv_seg, bk, -2))

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def query_block(xs):
        q, pos, seg = xs

        @functools.partial(jax.checkpoint, prevent_cse=False)
        def key_block(carry, kv):
            k, v, k_pos, k_seg = kv
            mask = attention_mask(pos, k_pos, seg, k_seg, window)

            def attend(carry):
                return merge_partials(*carry, *block_attention(q, k, v, mask, scale=scale))

            return jax.lax.cond(jnp.any(mask), attend, lambda c: c, carry), None

        init = (jnp.zeros((B, bq, N, Hv), jnp.float32), jnp.full((B, bq, N), _MASKED))
        return jax.lax.scan(key_block, init, ks)[0]

    qs = (_blocks(q_BLNH, bq, 0), _blocks(q_pos, bq, 0), _blocks(q_seg, bq, -1))
    out, lse = jax.lax.map(query_block, qs)
    out = jnp.moveaxis(out, 0, 1).reshape(B, -1, N, Hv)[:, :L]
    return out, jnp.moveaxis(lse, 0, 1).reshape(B, -1, N)[:, :L]
