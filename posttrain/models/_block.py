"""One decoder block: grouped-query self-attention, then the MLP or the experts, pre-norm."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from posttrain.models._attention import attention
from posttrain.models._config import ModelConfig
from posttrain.models._invariant import invariant_layer
from posttrain.models._mla import mla_attention
from posttrain.models._moe import moe_forward
from posttrain.models._ops import dense, rms_norm
from posttrain.models._rope import apply_rope, layer_rope
from posttrain.parallel import constrain


def _attention(
    h_BLD,
    a,
    window_index,
    k_cache_BSKH,
    v_cache_BSKH,
    *,
    config: ModelConfig,
    impl: str,
    windows: tuple[int, ...],
    cos,
    sin,
    positions_BL,
    segment_ids_BL,
    kv_positions_BS=None,
    kv_segment_ids_BS=None,
    cache_update=None,
    cache_attend=None,
    blocks_BL=None,
    kv_blocks_BS=None,
    zigzag_rows: bool = False,
):
    """Grouped-query self-attention of normed `h_BLD`: `(out_BLD, (k, v) cache or None)`;
    `blocks_BL`, `kv_blocks_BS`: bidirectional image blocks (`attention_mask`) of the queries
    and, with a cache, of its slots (default: the queries')."""
    dt = config.dtype
    q_BLNH = dense(h_BLD, a["q"].astype(dt))
    k_BLKH = dense(h_BLD, a["k"].astype(dt))
    v_BLKH = dense(h_BLD, a["v"].astype(dt))
    if config.qkv_bias:
        q_BLNH += a["q_bias"].astype(dt)
        k_BLKH += a["k_bias"].astype(dt)
        v_BLKH += a["v_bias"].astype(dt)
    if config.qk_norm:
        q_BLNH = rms_norm(q_BLNH, a["q_norm"], config.norm_eps, config.norm_offset)
        k_BLKH = rms_norm(k_BLKH, a["k_norm"], config.norm_eps, config.norm_offset)
    sliding = jnp.asarray([w > 0 for w in windows])[window_index]  # (Gemma 3's local rope)
    cos, sin = layer_rope(cos, sin, config, sliding)
    q_BLNH = constrain(apply_rope(q_BLNH, cos, sin), ("act_batch", "act_length", "act_heads", None))
    k_BLKH = constrain(
        apply_rope(k_BLKH, cos, sin), ("act_batch", "act_length", "act_kv_heads", None)
    )
    v_BLKH = constrain(v_BLKH, ("act_batch", "act_length", "act_kv_heads", None))

    new_cache = None
    if k_cache_BSKH is None:
        kv_positions_BS, kv_segment_ids_BS = positions_BL, segment_ids_BL
    elif cache_attend is None:  # cache attention uses the XLA reference
        if v_cache_BSKH is None:  # one store holds keys and values (a combined paged pool)
            k_store, (k_BLKH, v_BLKH) = cache_update(k_cache_BSKH, (k_BLKH, v_BLKH))
            v_store = None
        else:
            k_store, k_BLKH = cache_update(k_cache_BSKH, k_BLKH)
            v_store, v_BLKH = cache_update(v_cache_BSKH, v_BLKH)
        new_cache, impl = (k_store, v_store), "xla"
    if cache_attend is not None:  # a paged-attention kernel writes the pool and attends
        if config.attn_softcap:
            raise ValueError("the paged-attention kernel does not soft-cap attention logits")
        scale = config.scale
        attend = [
            lambda q, k, v, w=w: cache_attend(k_cache_BSKH, q, k, v, window=w, scale=scale)
            for w in windows
        ]
    else:
        attend = [
            functools.partial(
                attention,
                window=w,
                impl=impl,
                q_positions_BL=positions_BL,
                kv_positions_BS=kv_positions_BS,
                q_segment_ids_BL=segment_ids_BL,
                kv_segment_ids_BS=kv_segment_ids_BS,
                self_attention=k_cache_BSKH is None,
                scale=config.scale,
                softcap=config.attn_softcap,
                context_parallel=config.context_parallel,
                zigzag_rows=zigzag_rows,
                q_blocks_BL=blocks_BL,
                kv_blocks_BS=blocks_BL if kv_blocks_BS is None else kv_blocks_BS,
            )
            for w in windows
        ]
    if len(attend) == 1:
        o_BLNH = attend[0](q_BLNH, k_BLKH, v_BLKH)
    else:  # layers differ in window size: pick this layer's statically-compiled variant
        o_BLNH = jax.lax.switch(window_index, attend, q_BLNH, k_BLKH, v_BLKH)
    if cache_attend is not None:
        k_store, o_BLNH = o_BLNH
        new_cache = (k_store, None)
    attn_BLD = dense(o_BLNH, a["o"].astype(dt), contract=2)
    if config.o_bias:
        attn_BLD += a["o_bias"].astype(dt)
    return attn_BLD, new_cache


def _layer(
    x_BLD,
    p,
    window_index,
    k_cache_BSKH=None,
    v_cache_BSKH=None,
    replay_BLK=None,
    *,
    config: ModelConfig,
    impl: str,
    windows: tuple[int, ...],
    cos,
    sin,
    positions_BL,
    segment_ids_BL,
    kv_positions_BS=None,
    kv_segment_ids_BS=None,
    cache_update=None,
    cache_attend=None,
    blocks_BL=None,
    kv_blocks_BS=None,
    zigzag_rows: bool = False,
):
    """One pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)) (or the experts, routed
    as `replay_BLK` says when given: router replay, see `moe_forward`).

    Returns `(x, (cache, aux))`: with a cache (this layer's `k_cache_BSKH`, `v_cache_BSKH`
    stores) `cache_update(store, new)` writes the new keys and values and returns what the
    queries attend over; the updated (k, v) stores come back; `aux` holds the MoE layer's
    losses and counts (empty for a dense block).
    """
    if config.batch_invariant:  # every per-token step in fixed row tiles (`_invariant`)
        if cache_attend is not None or config.mla is not None:
            raise ValueError("batch_invariant runs without MLA or a fused paged-attention kernel")
        window = windows[0] if len(windows) == 1 else jnp.asarray(windows)[window_index]
        return invariant_layer(
            x_BLD, p, window, k_cache_BSKH, v_cache_BSKH, replay_BLK, config=config, cos=cos,
            sin=sin, positions_BL=positions_BL, segment_ids_BL=segment_ids_BL,
            kv_positions_BS=kv_positions_BS, kv_segment_ids_BS=kv_segment_ids_BS,
            cache_update=cache_update,
        )  # fmt: skip
    dt = config.dtype

    def norm(x, name):
        return rms_norm(x, p[name], config.norm_eps, config.norm_offset)

    h_BLD = norm(x_BLD, "attn_norm")
    context = dict(
        config=config,
        impl=impl,
        cos=cos,
        sin=sin,
        positions_BL=positions_BL,
        segment_ids_BL=segment_ids_BL,
        kv_positions_BS=kv_positions_BS,
        kv_segment_ids_BS=kv_segment_ids_BS,
        cache_update=cache_update,
        zigzag_rows=zigzag_rows,
    )
    if config.mla is not None:
        attn_BLD, k_cache = mla_attention(h_BLD, p["attn"], cache_BS1C=k_cache_BSKH, **context)
        new_cache = None if k_cache is None else (k_cache, v_cache_BSKH)
    else:
        attn_BLD, new_cache = _attention(
            h_BLD,
            p["attn"],
            window_index,
            k_cache_BSKH,
            v_cache_BSKH,
            windows=windows,
            cache_attend=cache_attend,
            blocks_BL=blocks_BL,
            kv_blocks_BS=kv_blocks_BS,
            **context,
        )
    if config.post_norms:
        attn_BLD = norm(attn_BLD, "attn_post_norm")
    x_BLD = constrain(x_BLD + attn_BLD, ("act_batch", "act_length", "act_embed"))

    h_BLD = norm(x_BLD, "mlp_norm")
    aux = {}
    if "moe" in p:
        y_BLD, aux = moe_forward(
            p["moe"], h_BLD, config.moe, token_mask_BL=segment_ids_BL != 0, replay_BLK=replay_BLK
        )
    else:
        m = p["mlp"]
        gate_BLF = dense(h_BLD, m["gate"].astype(dt))
        up_BLF = dense(h_BLD, m["up"].astype(dt))
        if config.mlp_activation == "gelu_tanh":
            gate_BLF = jax.nn.gelu(gate_BLF, approximate=True)
        else:
            gate_BLF = jax.nn.silu(gate_BLF)
        act_BLF = constrain(gate_BLF * up_BLF, ("act_batch", "act_length", "act_mlp"))
        y_BLD = dense(act_BLF, m["down"].astype(dt))
    if config.post_norms:
        y_BLD = norm(y_BLD, "mlp_post_norm")
    x_BLD = constrain(x_BLD + y_BLD, ("act_batch", "act_length", "act_embed"))
    return x_BLD, (new_cache, aux)
