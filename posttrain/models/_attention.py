"""Causal self-attention with packing (segment ids), GQA and sliding windows.

Four implementations share one signature: the XLA reference (every backend, positions-based
masks, also right for KV caches), its blocked online-softmax form (`flash`, every backend,
memory linear in length: `posttrain.models._flash`), cuDNN flash attention on GPU and the
splash Pallas kernel on TPU. The fused kernels mask by index, which equals the positions-based
mask for training rows (positions count up inside each packed document).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from posttrain.models._context import context_parallel_attention, length_axes
from posttrain.models._flash import _MASKED, attention_mask, flash_attention
from posttrain.parallel import logical_to_spec


def _target_platform() -> str:
    """The platform being compiled for: the mesh's devices (AOT for TPU from a CPU host), else
    JAX's default backend."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return device.platform if device is not None else jax.default_backend()


def resolve_impl(impl: str, dtype=None, softcap: bool = False) -> str:
    """Turns `auto` into the fastest implementation for the target and the compute `dtype`
    (cuDNN's fused kernel takes 16-bit inputs only and no logit soft-capping: those models
    use XLA on GPU); checks explicit choices."""
    platform = _target_platform()
    half = dtype is None or jnp.dtype(dtype).itemsize == 2
    if impl == "auto":
        gpu = "cudnn" if half and not softcap else "xla"
        return {"gpu": gpu, "tpu": "splash"}.get(platform, "xla")
    wanted = {"cudnn": "gpu", "splash": "tpu"}.get(impl)
    if wanted is not None and platform != wanted:
        raise ValueError(
            f"attention={impl!r} runs on {wanted.upper()} only, but JAX's backend is "
            f"{platform!r}; set model.attention to 'auto' or 'xla'"
        )
    if impl == "cudnn" and not half:
        raise ValueError(
            f"attention='cudnn' needs bfloat16 or float16 compute, not {jnp.dtype(dtype).name}; "
            "set model.compute_dtype=bfloat16 or model.attention to 'auto' or 'xla'"
        )
    return impl


def attention(
    q_BLNH,
    k_BSKH,
    v_BSKH,
    *,
    q_positions_BL,
    kv_positions_BS,
    q_segment_ids_BL,
    kv_segment_ids_BS,
    window: int = 0,
    impl: str = "xla",
    self_attention: bool = False,
    scale: float | None = None,
    softcap: float = 0.0,
    context_parallel: str = "ring",
    zigzag_rows: bool = False,
    q_blocks_BL=None,
    kv_blocks_BS=None,
):
    """Scaled dot-product attention of queries over keys, causal by position.

    Args:
      q_BLNH, k_BSKH, v_BSKH: queries, keys and values; N must be a multiple of K (GQA). The
        values' head dim may differ from the queries' and keys' (MLA).
      q_positions_BL, kv_positions_BS: token positions; a query sees keys at positions <= its own.
      q_segment_ids_BL, kv_segment_ids_BS: packed-document ids; attention stays inside a document.
      window: if > 0, a query sees only keys with `q_pos - kv_pos < window` (sliding window).
      impl: "xla", "flash" (XLA in blocks, memory linear in length), "cudnn" or "splash" (see
        `resolve_impl`).
      self_attention: queries and keys are the same tokens, with positions increasing along
        each document (training rows, packed or padded). The XLA path then skips key blocks
        that lie after each query block (all masked), as the fused kernels do.
      scale: multiplies the scores; default `1/sqrt(H)`.
      softcap: if > 0, the scaled scores become `softcap * tanh(scores / softcap)` (Gemma 2).
      context_parallel: "ring" or "all_gather": how self-attention reaches the other devices'
        keys when the rows' length is sharded (the `sequence` axis); any `impl` then runs as
        blocked XLA attention per shard (`posttrain.models._context`).
      zigzag_rows: the length-sharded rows are in the ring's load-balanced order
        (`posttrain.models.zigzag_rows`: the transformer reorders them once for its layers).
      q_blocks_BL, kv_blocks_BS: bidirectional blocks (see `attention_mask`): tokens of one
        block > 0 see each other both ways (Gemma 3's images). They run the XLA reference
        whatever `impl` says (the fused and blocked kernels skip keys after the query).

    Returns:
      The attended values, `[B, L, N, Hv]` in the dtype of `q_BLNH`.
    """
    H, Hv = q_BLNH.shape[-1], v_BSKH.shape[-1]
    scale = H**-0.5 if scale is None else scale
    args = (q_positions_BL, kv_positions_BS, q_segment_ids_BL, kv_segment_ids_BS, window)
    if softcap and impl == "cudnn":
        raise ValueError("attention='cudnn' has no logit soft-capping; use 'xla' or 'flash'")
    if q_blocks_BL is not None:
        if self_attention and length_axes(q_BLNH):
            raise ValueError("context parallelism does not run bidirectional image blocks yet")
        blocks = dict(blocks=(q_blocks_BL, kv_blocks_BS))
        return _xla_attention(q_BLNH, k_BSKH, v_BSKH, *args, scale=scale, softcap=softcap, **blocks)
    if self_attention and length_axes(q_BLNH):
        if softcap:
            raise ValueError("context parallelism does not soft-cap attention logits yet")
        return context_parallel_attention(
            q_BLNH, k_BSKH, v_BSKH, *args, scale=scale, mode=context_parallel,
            zigzag_rows=zigzag_rows,
        )  # fmt: skip
    if impl == "flash":
        return flash_attention(q_BLNH, k_BSKH, v_BSKH, *args, scale=scale, softcap=softcap,
                               causal_order=self_attention)  # fmt: skip
    if impl == "xla":
        if self_attention:
            return _xla_causal_blocks(q_BLNH, k_BSKH, v_BSKH, *args, scale=scale, softcap=softcap)
        return _xla_attention(q_BLNH, k_BSKH, v_BSKH, *args, scale=scale, softcap=softcap)
    if impl not in ("cudnn", "splash"):
        raise ValueError(f"unknown attention implementation {impl!r}")
    if Hv < H:  # the fused kernels want one head dim: pad the values, drop the padding after
        v_BSKH = jnp.pad(v_BSKH, ((0, 0), (0, 0), (0, 0), (0, H - Hv)))
    elif Hv > H:
        raise ValueError(f"value head dim {Hv} above the query/key head dim {H} (use xla)")
    if impl == "cudnn":
        out = _cudnn_attention(
            q_BLNH, k_BSKH, v_BSKH, q_segment_ids_BL, kv_segment_ids_BS, window, scale
        )
    else:
        out = _splash_attention(
            q_BLNH, k_BSKH, v_BSKH, q_segment_ids_BL, kv_segment_ids_BS, window, scale, softcap
        )
    return out[..., :Hv]


def _xla_attention(
    q_BLNH, k_BSKH, v_BSKH, q_pos, kv_pos, q_seg, kv_seg, window, *, scale, softcap=0.0,
    blocks=(None, None),
):  # fmt: skip
    # Batched 3-D matmuls with (batch x kv-head) leading and an additive mask: XLA:CPU runs
    # these far faster than 5-D einsums with a select, and the additive mask needs nothing
    # saved for the backward pass. Each kv head serves its G query heads as G*L rows.
    B, L, N, H = q_BLNH.shape
    S, K, Hv = k_BSKH.shape[1], k_BSKH.shape[2], v_BSKH.shape[3]
    G = N // K
    q_XRH = q_BLNH.reshape(B, L, K, G, H).transpose(0, 2, 3, 1, 4).reshape(B * K, G * L, H)
    k_XSH = k_BSKH.transpose(0, 2, 1, 3).reshape(B * K, S, H)
    v_XSH = v_BSKH.transpose(0, 2, 1, 3).reshape(B * K, S, Hv)
    scores_XRS = (
        jax.lax.dot_general(
            q_XRH, k_XSH, (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32
        )
        * scale
    )
    if softcap:
        scores_XRS = softcap * jnp.tanh(scores_XRS / softcap)
    mask_BLS = attention_mask(q_pos, kv_pos, q_seg, kv_seg, window, *blocks)
    bias_B11LS = jnp.where(mask_BLS, 0.0, _MASKED)[:, None, None]
    scores_BKGLS = scores_XRS.reshape(B, K, G, L, S) + bias_B11LS
    probs_XRS = jax.nn.softmax(scores_BKGLS, axis=-1).astype(v_BSKH.dtype).reshape(B * K, G * L, S)
    out_XRH = jax.lax.dot_general(probs_XRS, v_XSH, (((2,), (1,)), ((0,), (0,))))
    return out_XRH.reshape(B, K, G, L, Hv).transpose(0, 3, 1, 2, 4).reshape(B, L, N, Hv)


def _xla_causal_blocks(
    q_BLNH,
    k_BSKH,
    v_BSKH,
    q_pos,
    kv_pos,
    q_seg,
    kv_seg,
    window,
    *,
    scale,
    softcap=0.0,
    block: int = 32,
):
    """Self-attention by query blocks, each over only the keys it can see: keys after the
    block are causally masked, keys before `start - window` fall outside the window. Saves
    about half the score memory and FLOPs at long lengths."""
    L = q_BLNH.shape[1]
    if L <= block:
        return _xla_attention(
            q_BLNH,
            k_BSKH,
            v_BSKH,
            q_pos,
            kv_pos,
            q_seg,
            kv_seg,
            window,
            scale=scale,
            softcap=softcap,
        )
    outs = []
    for start in range(0, L, block):
        stop = min(start + block, L)
        lo = max(0, start - window + 1) if window else 0
        outs.append(
            _xla_attention(
                q_BLNH[:, start:stop],
                k_BSKH[:, lo:stop],
                v_BSKH[:, lo:stop],
                q_pos[:, start:stop],
                kv_pos[:, lo:stop],
                q_seg[:, start:stop],
                kv_seg[:, lo:stop],
                window,
                scale=scale,
                softcap=softcap,
            )
        )
    return jnp.concatenate(outs, axis=1)


def _cudnn_attention(q_BLNH, k_BSKH, v_BSKH, q_seg, kv_seg, window, scale):
    segment_mask_B1LS = (q_seg[:, :, None] == kv_seg[:, None, :])[:, None]
    return jax.nn.dot_product_attention(
        q_BLNH,
        k_BSKH,
        v_BSKH,
        mask=segment_mask_B1LS,
        is_causal=True,
        local_window_size=(window - 1, 0) if window else None,
        scale=scale,
        implementation="cudnn",
    )


def _splash_attention(q_BLNH, k_BSKH, v_BSKH, q_seg, kv_seg, window, scale, softcap=0.0):
    L, S = q_BLNH.shape[1], k_BSKH.shape[1]
    if L % 128 or S % 128:
        raise ValueError(
            f"splash attention needs sequence lengths that are multiples of 128, "
            f"got {L} and {S}; pad the batch or set model.attention='xla'"
        )
    mesh = jax.sharding.get_abstract_mesh()
    local = functools.partial(_splash_local, window=window, scale=scale, softcap=softcap)
    if mesh.empty:
        return local(q_BLNH, k_BSKH, v_BSKH, q_seg, kv_seg)
    # Pallas kernels see one device's block: batch and heads stay sharded, length is gathered.
    q_spec = logical_to_spec(("act_batch", None, "act_heads", None), q_BLNH.shape, mesh)
    kv_spec = logical_to_spec(("act_batch", None, "act_kv_heads", None), k_BSKH.shape, mesh)
    if len(q_spec) > 2 and (len(kv_spec) <= 2 or q_spec[2] != kv_spec[2]):
        # Query heads sharded but kv heads not: shard neither so groups stay on one device.
        q_spec = logical_to_spec(("act_batch",), q_BLNH.shape, mesh)
        kv_spec = q_spec
    seg_spec = jax.sharding.PartitionSpec(*q_spec[:1])
    return jax.shard_map(
        local,
        in_specs=(q_spec, kv_spec, kv_spec, seg_spec, seg_spec),
        out_specs=q_spec,
        check_vma=False,
    )(q_BLNH, k_BSKH, v_BSKH, q_seg, kv_seg)


def _splash_local(q_BLNH, k_BSKH, v_BSKH, q_seg, kv_seg, *, window, scale, softcap=0.0):
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as masks,
    )

    _, L, N, H = q_BLNH.shape
    S = k_BSKH.shape[1]
    base = masks.LocalMask((L, S), (window - 1, 0), 0) if window else masks.CausalMask((L, S))
    kernel = splash.make_splash_mha(
        masks.MultiHeadMask([base] * N),
        head_shards=1,
        q_seq_shards=1,
        attn_logits_soft_cap=softcap or None,
    )
    q_BNLH = (q_BLNH * scale).astype(q_BLNH.dtype).transpose(0, 2, 1, 3)
    k_BKSH, v_BKSH = k_BSKH.transpose(0, 2, 1, 3), v_BSKH.transpose(0, 2, 1, 3)
    segments = splash.SegmentIds(q=q_seg, kv=kv_seg)
    out_BNLH = jax.vmap(kernel)(q_BNLH, k_BKSH, v_BKSH, segment_ids=segments)
    return out_BNLH.transpose(0, 2, 1, 3)
