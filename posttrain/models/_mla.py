"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2).

Keys and values of a token come from one latent `c` of `kv_lora_rank` dims (RMS-normed) plus a
`qk_rope_head_dim` key that carries the position and is shared by every head:

    k_nope, v = split(c @ kv_b)            per head: qk_nope_head_dim + v_head_dim
    k = [k_nope, rope(k_rope)]             q = [q_nope, rope(q_rope)]   (q maybe via a latent)

Training runs that as written (ordinary attention over N heads with `qk_head_dim` keys and
`v_head_dim` values). With a KV cache only the latent and the rope key are stored (one "head"
of `kv_lora_rank + qk_rope_head_dim`) and the up-projections are absorbed into the query and
the output, so decoding attends over the latent directly:

    q_nope . k_nope = (q_nope @ kv_b_k^T) . c        out = (softmax(...) @ c) @ kv_b_v
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from posttrain.models._attention import attention
from posttrain.models._config import ModelConfig
from posttrain.models._ops import ParamSpec, dense, rms_norm
from posttrain.models._rope import apply_rope
from posttrain.parallel import constrain

# HF's DeepSeek-V3 builds the latent norms without passing rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def mla_param_specs(config: ModelConfig, num_layers: int) -> dict:
    m, T, D, N = config.mla, num_layers, config.embed_dim, config.num_heads
    specs = {
        "kv_a": ParamSpec(
            (T, D, m.kv_lora_rank + m.qk_rope_head_dim), ("layers", "embed", "kv_lora")
        ),
        "kv_norm": ParamSpec((T, m.kv_lora_rank), ("layers", "kv_lora"), "ones"),
        "kv_b": ParamSpec(
            (T, m.kv_lora_rank, N, m.qk_nope_head_dim + m.v_head_dim),
            ("layers", "kv_lora", "heads", "head_dim"),
        ),
        "o": ParamSpec((T, N, m.v_head_dim, D), ("layers", "heads", "head_dim", "embed")),
    }
    if m.q_lora_rank:
        specs["q_a"] = ParamSpec((T, D, m.q_lora_rank), ("layers", "embed", "q_lora"))
        specs["q_norm"] = ParamSpec((T, m.q_lora_rank), ("layers", "q_lora"), "ones")
        specs["q_b"] = ParamSpec(
            (T, m.q_lora_rank, N, m.qk_head_dim), ("layers", "q_lora", "heads", "head_dim")
        )
    else:
        specs["q"] = ParamSpec((T, D, N, m.qk_head_dim), ("layers", "embed", "heads", "head_dim"))
    return specs


def softmax_scale(config: ModelConfig) -> float:
    """`1/sqrt(qk_head_dim)`, times HF's YaRN `mscale_all_dim` correction squared."""
    scale = config.mla.qk_head_dim**-0.5
    rope = config.rope_scaling
    mscale_all_dim = getattr(rope, "mscale_all_dim", 0) if rope is not None else 0
    if rope is not None and rope.rope_type != "default" and mscale_all_dim and rope.factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(rope.factor) + 1.0
        scale *= mscale * mscale
    return scale


def mla_attention(
    h_BLD,
    a,
    *,
    config: ModelConfig,
    impl: str,
    cos,
    sin,
    positions_BL,
    segment_ids_BL,
    cache_BS1C=None,
    kv_positions_BS=None,
    kv_segment_ids_BS=None,
    cache_update=None,
    zigzag_rows: bool = False,
):
    """The attention output `[B, L, D]` of normed inputs `h_BLD`; with a latent cache store
    (entries of `kv_lora_rank + qk_rope_head_dim` as one head, written and read back by
    `cache_update(store, new)`), also the updated store (else None)."""
    m, dt = config.mla, config.dtype
    if m.q_lora_rank:
        q_lat = rms_norm(dense(h_BLD, a["q_a"].astype(dt)), a["q_norm"], LATENT_NORM_EPS)
        q_BLNQ = dense(q_lat, a["q_b"].astype(dt))
    else:
        q_BLNQ = dense(h_BLD, a["q"].astype(dt))
    q_nope, q_rope = q_BLNQ[..., : m.qk_nope_head_dim], q_BLNQ[..., m.qk_nope_head_dim :]
    q_rope = apply_rope(q_rope, cos, sin)
    kv_BLC = dense(h_BLD, a["kv_a"].astype(dt))
    c_BLR = rms_norm(kv_BLC[..., : m.kv_lora_rank], a["kv_norm"], LATENT_NORM_EPS)
    k_rope_BL1r = apply_rope(kv_BLC[:, :, None, m.kv_lora_rank :], cos, sin)
    kv_b = a["kv_b"].astype(dt)
    scale = softmax_scale(config)
    heads = ("act_batch", "act_length", "act_heads", None)

    if cache_BS1C is None:
        kv_BLNX = dense(c_BLR, kv_b)
        k_nope, v_BLNV = kv_BLNX[..., : m.qk_nope_head_dim], kv_BLNX[..., m.qk_nope_head_dim :]
        k_rope = jnp.broadcast_to(k_rope_BL1r, (*k_nope.shape[:3], m.qk_rope_head_dim))
        q = constrain(jnp.concatenate([q_nope, q_rope], axis=-1), heads)
        k = constrain(jnp.concatenate([k_nope, k_rope], axis=-1), heads)
        o_BLNV = attention(
            q,
            k,
            constrain(v_BLNV, heads),
            q_positions_BL=positions_BL,
            kv_positions_BS=positions_BL,
            q_segment_ids_BL=segment_ids_BL,
            kv_segment_ids_BS=segment_ids_BL,
            impl=impl,
            self_attention=True,
            scale=scale,
            context_parallel=config.context_parallel,
            zigzag_rows=zigzag_rows,
        )
        new_cache = None
    else:
        # Absorb kv_b's key half into the queries: they then score the latent directly.
        k_up_RNn, v_up_RNV = kv_b[..., : m.qk_nope_head_dim], kv_b[..., m.qk_nope_head_dim :]
        q_lat_BLNR = jnp.einsum("BLNn,RNn->BLNR", q_nope, k_up_RNn)
        q = constrain(jnp.concatenate([q_lat_BLNR, q_rope], axis=-1), heads)
        entry_BL1C = jnp.concatenate([c_BLR[:, :, None], k_rope_BL1r], axis=-1)
        new_cache, entries_BS1C = cache_update(cache_BS1C, entry_BL1C)
        o_lat_BLNR = attention(
            q,
            entries_BS1C,
            entries_BS1C[..., : m.kv_lora_rank],
            q_positions_BL=positions_BL,
            kv_positions_BS=kv_positions_BS,
            q_segment_ids_BL=segment_ids_BL,
            kv_segment_ids_BS=kv_segment_ids_BS,
            impl="xla",
            scale=scale,
        )
        o_BLNV = jnp.einsum("BLNR,RNV->BLNV", o_lat_BLNR, v_up_RNV)
    return dense(o_BLNV, a["o"].astype(dt), contract=2), new_cache
