"""Memory-bounded attention in plain JAX: queries in blocks, keys in blocks, online softmax.

`flash_attention` never holds more than one `[block_q, block_k]` tile of scores per (batch,
head): one `lax.scan` over the (query block, key block) tiles that can hold a visible key, each
step merging its tile into the query block's running output and log-normaliser
(FlashAttention's recurrence). Its backward pass is written out (FlashAttention-2's): the same
tiles again, each recomputing its probabilities from the saved log-normaliser and adding its
share of dq, dk and dv. So the step keeps only q, k, v, the output and the log-normaliser, and
computes each tile's matmuls 7 times (2 forward, 5 backward) where autodiff of a
rematerialised scan computed them up to 12 times; memory is linear in the length on any
backend (`model.attention="flash"`; the CPU and GPU fallback for long rows).

Which tiles run is decided twice. At trace time, with `causal_order` (queries and keys are the
same tokens, positions increasing by at least 1 along each document: training rows, packed or
padded), the tiles above the diagonal and those entirely farther back than the window are left
out of the program: neither computed nor counted in its FLOPs. At run time a tile whose mask is
empty (another document, padding) is skipped by a `lax.cond`.

`flash_partial` and `flash_grads` are the two passes over any keys, with `merge_partials`
combining partial results over disjoint key sets: the pieces ring attention (context
parallelism) runs at each rotation step, forward and backward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

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
                    scale: float, softcap: float = 0.0, block_q: int = 512, block_k: int = 512,
                    causal_order: bool = False):  # fmt: skip
    """Causal attention by position with packing and windows (as `attention(impl="xla")`), in
    query and key blocks, with its own backward pass; `[B, L, N, Hv]` in q's dtype.
    `causal_order`: see the module docstring."""
    tiles = (window, scale, softcap, block_q, block_k, causal_order)  # (static, hashable)
    return _flash(tiles, q_BLNH, k_BSKH, v_BSKH, q_pos, kv_pos, q_seg, kv_seg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(tiles, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    return _flash_fwd(tiles, q, k, v, q_pos, kv_pos, q_seg, kv_seg)[0]


def _flash_fwd(tiles, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    window, scale, softcap, block_q, block_k, causal_order = tiles
    out, lse = flash_partial(q, k, v, q_pos, kv_pos, q_seg, kv_seg, window, scale=scale,
                             softcap=softcap, block_q=block_q, block_k=block_k,
                             causal_order=causal_order)  # fmt: skip
    out = out.astype(q.dtype)
    return out, (q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse)


def _flash_bwd(tiles, residuals, d_out):
    window, scale, softcap, block_q, block_k, causal_order = tiles
    q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse = residuals
    d_out = d_out.astype(jnp.float32)
    dq, dk, dv = flash_grads(q, k, v, q_pos, kv_pos, q_seg, kv_seg, lse, d_out,
                             output_dot(d_out, out), window, scale=scale, softcap=softcap,
                             block_q=block_q, block_k=block_k,
                             causal_order=causal_order)  # fmt: skip
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def output_dot(d_out_BLNH, out_BLNH):
    """`rowsum(dO * O)` `[B, L, N]` float32: the softmax normaliser's share of the gradient
    (FlashAttention-2's D), from the whole attention's output."""
    return jnp.sum(d_out_BLNH.astype(jnp.float32) * out_BLNH.astype(jnp.float32), axis=-1)


def flash_partial(q_BLNH, k_BSKH, v_BSKH, q_pos, kv_pos, q_seg, kv_seg, window: int, *,
                  scale: float, softcap: float = 0.0, block_q: int = 512, block_k: int = 512,
                  causal_order: bool = False):  # fmt: skip
    """Attention of the queries over these keys in tiles, as a partial result: `(out float32,
    lse)` as `block_attention` returns them, for `merge_partials` with other keys' (ring
    attention). Not differentiable itself: `flash_attention` pairs it with `flash_grads`."""
    B, L, N, _ = q_BLNH.shape
    Hv = v_BSKH.shape[3]
    grid = _Grid(q_BLNH, k_BSKH, q_pos, kv_pos, q_seg, kv_seg, window, block_q, block_k,
                 causal_order)  # fmt: skip
    qs, vs = grid.query_blocks(q_BLNH), grid.key_blocks(v_BSKH)
    ks = grid.key_blocks(k_BSKH)

    # (Rematerialised though never differentiated: a layer scan's partial evaluation would
    # otherwise hoist each tile's mask, which depends only on positions, out of the loop over
    # layers and keep one for every tile and ring hop.)
    @functools.partial(jax.checkpoint, prevent_cse=False)
    def step(carry, ij):
        out, lse = carry
        i, j = ij
        q, k, v = qs[i], ks[j], vs[j]
        mask = grid.mask(i, j)

        def tile(partial):
            return merge_partials(*partial, *block_attention(q, k, v, mask, scale=scale,
                                                             softcap=softcap))  # fmt: skip

        o, l = jax.lax.cond(jnp.any(mask), tile, lambda p: p, (out[i], lse[i]))
        return (out.at[i].set(o), lse.at[i].set(l)), None

    init = (jnp.zeros((grid.nq, B, grid.bq, N, Hv), jnp.float32),
            jnp.full((grid.nq, B, grid.bq, N), _MASKED))  # fmt: skip
    out, lse = jax.lax.scan(step, init, grid.pairs)[0]
    return grid.rows(out, L), grid.rows(lse, L)


def flash_grads(q_BLNH, k_BSKH, v_BSKH, q_pos, kv_pos, q_seg, kv_seg, lse_BLN, d_out_BLNH,
                d_mass_BLN, window: int, *, scale: float, softcap: float = 0.0,
                block_q: int = 512, block_k: int = 512, causal_order: bool = False):  # fmt: skip
    """These keys' part of attention's gradient, in the tiles `flash_partial` runs: float32
    `(dq, dk, dv)`. `lse_BLN` is the log-normaliser over all the keys the queries attend
    (these and any others: ring attention), `d_out_BLNH` the output's cotangent and
    `d_mass_BLN` = `output_dot(d_out, out)` of the whole attention's output. Per tile
    (FlashAttention-2): `P = exp(S - lse)`, `dV += P^T dO`, `dS = P (dO V^T - D)`,
    `dQ += dS K`, `dK += dS^T Q`, through the soft-cap's tanh and the scale."""
    B, L, N, H = q_BLNH.shape
    S, K, Hv = k_BSKH.shape[1], k_BSKH.shape[2], v_BSKH.shape[3]
    G = N // K
    grid = _Grid(q_BLNH, k_BSKH, q_pos, kv_pos, q_seg, kv_seg, window, block_q, block_k,
                 causal_order)  # fmt: skip
    qs, ks, vs = grid.query_blocks(q_BLNH), grid.key_blocks(k_BSKH), grid.key_blocks(v_BSKH)
    dos = grid.query_blocks(d_out_BLNH.astype(jnp.float32))
    lses, masses = grid.query_blocks(lse_BLN), grid.query_blocks(d_mass_BLN)

    def heads(x_BLN):  # [B, L, N] -> [B, K, G, L]
        return x_BLN.reshape(B, -1, K, G).transpose(0, 2, 3, 1)

    def step(carry, ij):
        dq, dk, dv = carry
        i, j = ij
        q, k, v, do, mask = qs[i], ks[j], vs[j], dos[i], grid.mask(i, j)

        def tile(grads):
            dq_i, dk_j, dv_j = grads
            raw_BKGLS = _scores(q, k, mask, scale)  # (uncapped: the cap is applied below)
            s_BKGLS = softcap * jnp.tanh(raw_BKGLS / softcap) if softcap else raw_BKGLS
            p_BKGLS = jnp.where(mask[:, None, None], jnp.exp(s_BKGLS - heads(lses[i])[..., None]),
                                0.0)  # fmt: skip
            # Matmul operands in the inputs' dtype, float32 accumulation (FlashAttention-2).
            dot = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)
            do_BKGLV = do.reshape(B, -1, K, G, Hv).transpose(0, 2, 3, 1, 4).astype(v.dtype)
            dv_j = dv_j + dot("BKGLS,BKGLV->BSKV", p_BKGLS.astype(v.dtype), do_BKGLV)
            dp_BKGLS = dot("BKGLV,BSKV->BKGLS", do_BKGLV, v)
            ds_BKGLS = p_BKGLS * (dp_BKGLS - heads(masses[i])[..., None])
            if softcap:  # d(c tanh(x / c)) = 1 - tanh(x / c)^2
                ds_BKGLS = ds_BKGLS * (1.0 - jnp.square(s_BKGLS / softcap))
            ds_BKGLS = (ds_BKGLS * scale).astype(q.dtype)
            dq_BKGLH = dot("BKGLS,BSKH->BKGLH", ds_BKGLS, k)
            dq_i = dq_i + dq_BKGLH.transpose(0, 3, 1, 2, 4).reshape(dq_i.shape)
            q_BKGLH = q.reshape(B, -1, K, G, H).transpose(0, 2, 3, 1, 4)
            dk_j = dk_j + dot("BKGLS,BKGLH->BSKH", ds_BKGLS, q_BKGLH)
            return dq_i, dk_j, dv_j

        block = jax.lax.cond(jnp.any(mask), tile, lambda g: g, (dq[i], dk[j], dv[j]))
        return (dq.at[i].set(block[0]), dk.at[j].set(block[1]), dv.at[j].set(block[2])), None

    zeros = lambda n, b, heads, dim: jnp.zeros((n, B, b, heads, dim), jnp.float32)  # noqa: E731
    init = (zeros(grid.nq, grid.bq, N, H), zeros(grid.nk, grid.bk, K, H),
            zeros(grid.nk, grid.bk, K, Hv))  # fmt: skip
    dq, dk, dv = jax.lax.scan(step, init, grid.pairs)[0]
    return grid.rows(dq, L), grid.rows(dk, S), grid.rows(dv, S)


class _Grid:
    """The tiles of queries `[B, L]` by keys `[B, S]` in blocks of `block_q` x `block_k`: the
    (query block, key block) pairs that run, in order (`pairs`, two int32 arrays), and each
    tile's mask. Padded queries and keys belong to no document (ids -1, -2): they see and are
    seen by nothing, and `rows` cuts their outputs off."""

    def __init__(self, q_BLNH, k_BSKH, q_pos, kv_pos, q_seg, kv_seg, window, block_q, block_k,
                 causal_order):  # fmt: skip
        L, S = q_BLNH.shape[1], k_BSKH.shape[1]
        self.bq, self.bk = min(block_q, L), min(block_k, S)
        self.nq, self.nk = -(-L // self.bq), -(-S // self.bk)
        self.window = window
        self.q_pos, self.q_seg = _blocks(q_pos, self.bq, 0), _blocks(q_seg, self.bq, -1)
        self.kv_pos, self.kv_seg = _blocks(kv_pos, self.bk, 0), _blocks(kv_seg, self.bk, -2)
        pairs = [(i, j) for i in range(self.nq) for j in range(self.nk)
                 if not causal_order or self._may_see(i, j)]  # fmt: skip
        self.pairs = tuple(jnp.asarray(np.asarray(pairs, np.int32).reshape(-1, 2).T))

    def _may_see(self, i: int, j: int) -> bool:
        """Whether a query of block i can see a key of block j when both are the same row's
        tokens with positions increasing by at least 1 along each document (`causal_order`):
        some key not after some query, and (with a window) some pair nearer than it (index
        distances are at most position distances within a document)."""
        first_q, last_q = i * self.bq, (i + 1) * self.bq - 1
        first_k, last_k = j * self.bk, (j + 1) * self.bk - 1
        return first_k <= last_q and not (self.window and first_q - last_k >= self.window)

    def mask(self, i, j):
        return attention_mask(self.q_pos[i], self.kv_pos[j], self.q_seg[i], self.kv_seg[j],
                              self.window)  # fmt: skip

    def query_blocks(self, x):
        return _blocks(x, self.bq, 0)

    def key_blocks(self, x):
        return _blocks(x, self.bk, 0)

    @staticmethod
    def rows(x, length: int):
        """`[n, B, b, ...]` -> `[B, length, ...]`."""
        return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, *x.shape[3:])[:, :length]
