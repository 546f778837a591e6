"""Context parallelism: self-attention over rows whose length is sharded (the `sequence` axis).

Every other layer of the model works on its own positions, so once `act_length` maps to a mesh
axis only attention needs the other devices' keys. Two ways, chosen by
`ModelConfig.context_parallel`:

- `ring`: each device keeps its queries and passes its keys and values (with their positions
  and document ids) around the ring with `ppermute`, one hop per step; each step's partial
  attention (`flash_partial`, blocked, rematerialised) is merged into the running one by its
  log-normaliser (`merge_partials`). No device ever holds more than two key shards.
- `all_gather`: each device gathers every key and value shard once and attends its queries
  over all of them (one collective instead of n - 1 hops; the whole length's keys per device
  while a layer runs).

Both mask by positions and document ids, so packing, sliding windows, GQA and MLA's value heads
work unchanged, and both differentiate through the collectives (`ppermute`'s transpose is the
reverse ring). Key blocks a query block cannot see are skipped inside `flash_partial`; rows
are sharded contiguously, so with causal masks the first devices skip most of their steps (no
load-balanced reordering yet).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from posttrain.models._config import CONTEXT_PARALLEL
from posttrain.models._flash import flash_partial, flash_terms, merge_partials
from posttrain.parallel import logical_to_spec


def length_axes(q_BLNH) -> tuple[str, ...]:
    """The mesh axes the rows' length is sharded over in the current mesh (empty: none)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    spec = logical_to_spec(("act_batch", "act_length"), q_BLNH.shape[:2], mesh)
    axes = spec[1] if len(spec) > 1 else None
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def context_parallel_attention(q_BLNH, k_BSKH, v_BSKH, q_pos, kv_pos, q_seg, kv_seg,
                               window: int, *, scale: float, mode: str = "ring"):  # fmt: skip
    """Self-attention of length-sharded rows (see the module docstring); `[B, L, N, Hv]` in q's
    dtype. Batch and heads stay sharded as the activations are."""
    if mode not in CONTEXT_PARALLEL:
        raise ValueError(f"context_parallel={mode!r}; choose one of {CONTEXT_PARALLEL}")
    mesh = jax.sharding.get_abstract_mesh()
    axes = length_axes(q_BLNH)
    q_spec = logical_to_spec(("act_batch", "act_length", "act_heads", None), q_BLNH.shape, mesh)
    kv_spec = logical_to_spec(("act_batch", "act_length", "act_kv_heads", None), k_BSKH.shape, mesh)
    q_heads = q_spec[2] if len(q_spec) > 2 else None
    kv_heads = kv_spec[2] if len(kv_spec) > 2 else None
    if q_heads != kv_heads:  # a query head's kv head on another device: shard neither
        q_spec, kv_spec = PartitionSpec(*q_spec[:2]), PartitionSpec(*kv_spec[:2])
    row_spec = PartitionSpec(*q_spec[:2])
    n = math.prod(mesh.shape[a] for a in axes)
    axis = axes[0] if len(axes) == 1 else axes
    attend = functools.partial(flash_partial, window=window, scale=scale)

    def local(q, k, v, qp, kp, qs, ks):
        if mode == "all_gather":
            gather = functools.partial(jax.lax.all_gather, axis_name=axis, axis=1, tiled=True)
            out, _ = attend(q, gather(k), gather(v), qp, gather(kp), qs, gather(ks))
            return out.astype(q.dtype)
        out = _ring(axis, n, window, scale, q, k, v, qp, kp, qs, ks)
        return out.astype(q.dtype)

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec, row_spec, row_spec, row_spec, row_spec),
        out_specs=q_spec,
        check_vma=False,
    )(q_BLNH, k_BSKH, v_BSKH, q_pos, kv_pos, q_seg, kv_seg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _ring(axis, n, window, scale, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    """Ring attention of this device's queries over every device's keys (inside `shard_map`):
    float32 `[B, L, N, Hv]`. A custom VJP, so the backward pass keeps only this device's q, k,
    v, output and log-normaliser: it passes the keys around the ring again, with their gradient
    accumulators, and each hop adds its part (`flash_terms`)."""
    return _ring_forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, axis, n, window, scale)[0]


def _ring_forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, axis, n, window, scale):
    ring = [(i, (i + 1) % n) for i in range(n)]
    attend = functools.partial(flash_partial, window=window, scale=scale)

    def hop(carry, _):
        partial, shard = carry
        shard = jax.lax.ppermute(shard, axis, ring)
        k, v, kp, ks = shard
        return (merge_partials(*partial, *attend(q, k, v, q_pos, kp, q_seg, ks)), shard), None

    own = attend(q, k, v, q_pos, kv_pos, q_seg, kv_seg)
    (partial, _), _ = jax.lax.scan(hop, (own, (k, v, kv_pos, kv_seg)), length=n - 1)
    return partial


def _ring_fwd(axis, n, window, scale, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    out, lse = _ring_forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, axis, n, window, scale)
    return out, (q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse)


def _ring_bwd(axis, n, window, scale, residuals, d_out):
    q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse = residuals
    ring = [(i, (i + 1) % n) for i in range(n)]
    d_mass = -jnp.sum(d_out * out, axis=-1)  # -rowsum(dO * O): the normaliser's share

    def hop(carry, _):
        dq, shard = carry
        k, v, kp, ks, dk, dv = shard
        terms = lambda q, k, v: flash_terms(q, k, v, q_pos, kp, q_seg, ks, lse, window,  # noqa: E731
                                            scale=scale)  # fmt: skip
        _, vjp = jax.vjp(terms, q, k, v)
        dq_hop, dk_hop, dv_hop = vjp((d_out, d_mass))
        # After n hops every shard, with its gradient, is back on its own device.
        shard = jax.lax.ppermute((k, v, kp, ks, dk + dk_hop, dv + dv_hop), axis, ring)
        return (dq + dq_hop, shard), None

    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)  # noqa: E731
    init = (zeros(q), (k, v, kv_pos, kv_seg, zeros(k), zeros(v)))
    (dq, (*_, dk, dv)), _ = jax.lax.scan(hop, init, length=n)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None)


_ring.defvjp(_ring_fwd, _ring_bwd)
