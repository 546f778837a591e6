"""Context parallelism: self-attention over rows whose length is sharded (the `sequence` axis).

Every other layer of the model works on its own positions, so once `act_length` maps to a mesh
axis only attention needs the other devices' keys. Two ways, chosen by
`ModelConfig.context_parallel`:

- `ring`: each device keeps its queries and passes its keys and values (with their positions
  and document ids) around the ring with `ppermute`, one hop per step; each step's partial
  attention (`flash_partial`) is merged into the running one by its log-normaliser
  (`merge_partials`). No device ever holds more than two key shards. The rows are in zigzag
  order (`zigzag_rows`: with 2n chunks over n devices, device d holds chunks d and 2n-1-d), so
  under a causal mask every device does the same work at every hop: two half tiles (`_ring`).
  Contiguous chunks would leave device 0 idle at all n - 1 hops while device n-1 computes
  whole tiles. The backward pass is written out (`flash_grads`), and the output and
  log-normaliser are named "context_attention" for the remat policies to keep, so the
  forward hops run once.
- `all_gather`: each device gathers every key and value shard once and attends its queries
  over all of them (one collective instead of n - 1 hops; the whole length's keys per device
  while a layer runs).

Both mask by positions and document ids, so packing, sliding windows, GQA and MLA's value heads
work unchanged. Tiles no query can see are left out of the program where the order says so
(`causal_order`) and skipped at run time where only the ids do (other documents). Not yet: a
fused kernel (TPU splash, cuDNN) per ring step; each step runs the blocked XLA tiles.
"""

from __future__ import annotations

import functools
import logging
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name as _checkpoint_name
from jax.sharding import PartitionSpec

from posttrain.models._config import CONTEXT_PARALLEL
from posttrain.models._flash import (
    _MASKED,
    flash_attention,
    flash_grads,
    flash_partial,
    merge_partials,
    output_dot,
)
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
                               window: int, *, scale: float, mode: str = "ring",
                               zigzag_rows: bool = False):  # fmt: skip
    """Self-attention of length-sharded rows (see the module docstring); `[B, L, N, Hv]` in q's
    dtype. Batch and heads stay sharded as the activations are. `zigzag_rows`: the rows are
    already in `zigzag` order (the transformer reorders them once for all its layers); else
    the ring reorders this call's inputs and output."""
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
    n = ring_devices(q_BLNH)
    if mode == "ring" and q_BLNH.shape[1] % (2 * n):
        # The ring splits rows into 2n chunks (two a device, for causal load balance).
        _warn_once(
            f"rows of {q_BLNH.shape[1]} tokens do not split into 2 x {n} chunks for ring "
            f"attention over {axes}: gathering keys instead (context_parallel=all_gather; "
            f"make the length a multiple of {2 * n} for the ring)"
        )
        mode = "all_gather"
    axis = axes[0] if len(axes) == 1 else axes
    attend = functools.partial(flash_attention, window=window, scale=scale)

    def local(q, k, v, qp, kp, qs, ks):
        if mode == "all_gather":
            gather = functools.partial(jax.lax.all_gather, axis_name=axis, axis=1, tiled=True)
            return attend(q, gather(k), gather(v), qp, gather(kp), qs, gather(ks))
        if n == 1:
            return attend(q, k, v, qp, kp, qs, ks, causal_order=True)
        if zigzag_rows:
            return _ring(axis, n, window, scale, q, k, v, qp, kp, qs, ks)
        order = functools.partial(_to_zigzag, axis=axis, n=n)
        out = _ring(axis, n, window, scale, *map(order, (q, k, v, qp, kp, qs, ks)))
        return _from_zigzag(out, axis, n)

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec, row_spec, row_spec, row_spec, row_spec),
        out_specs=q_spec,
        check_vma=False,
    )(q_BLNH, k_BSKH, v_BSKH, q_pos, kv_pos, q_seg, kv_seg)


def zigzag_rows(x, names: tuple, *, inverse: bool = False):
    """`x` (`[B, L, ...]`, `names` its logical axes) with each row's length-sharded tokens in
    the ring's load-balanced order, or (`inverse`) back in their own order. With 2n chunks of
    a row over n devices, device d holds chunks d and 2n-1-d instead of 2d and 2d+1: an early
    chunk, whose queries see few keys, and a late one, which see many. Every layer but
    attention works token by token, so the transformer reorders its inputs (embeddings,
    positions, documents) once and its output once (`hidden_states`). `x` itself if the
    length is not sharded."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = length_axes(x)
    if not axes:
        return x
    n = ring_devices(x)
    spec = logical_to_spec(names, x.shape, mesh)
    move = _from_zigzag if inverse else _to_zigzag
    axis = axes[0] if len(axes) == 1 else axes
    return jax.shard_map(lambda x: move(x, axis, n), mesh=mesh, in_specs=spec, out_specs=spec,
                         check_vma=False)(x)  # fmt: skip


def ring_devices(x) -> int:
    """How many devices share each row of `x` (`[B, L, ...]`) along its length (1: none)."""
    mesh = jax.sharding.get_abstract_mesh()
    return math.prod(mesh.shape[a] for a in length_axes(x))


@functools.cache
def _warn_once(message: str) -> None:
    logging.getLogger("posttrain").warning(message)


def _to_zigzag(x, axis, n: int):
    """Rows of this device's contiguous share (chunks 2d and 2d+1 of 2n) -> its zigzag share
    (chunks d and 2n-1-d), inside `shard_map`: two `ppermute`s, one per half."""
    slot = lambda c: c if c < n else 2 * n - 1 - c  # noqa: E731  (the device chunk c goes to)
    halves = _halves(x)
    got = [jax.lax.ppermute(h, axis, [(d, slot(2 * d + i)) for d in range(n)])
           for i, h in enumerate(halves)]  # fmt: skip
    # A device's first chunk (d) arrived with the even chunks when d is even.
    even = jax.lax.axis_index(axis) % 2 == 0
    return jnp.concatenate([_pick(even, *got), _pick(even, got[1], got[0])], axis=1)


def _from_zigzag(x, axis, n: int):
    """The inverse of `_to_zigzag`: each device sends its even-numbered chunk to the first
    half of that chunk's contiguous owner, and its odd one to the second half."""
    first, second = _halves(x)
    even = jax.lax.axis_index(axis) % 2 == 0
    chunk = lambda d, odd: d if d % 2 == odd else 2 * n - 1 - d  # noqa: E731
    got = [
        jax.lax.ppermute(part, axis, [(d, chunk(d, odd) // 2) for d in range(n)])
        for odd, part in enumerate((_pick(even, first, second), _pick(even, second, first)))
    ]
    return jnp.concatenate(got, axis=1)


def _halves(x):
    half = x.shape[1] // 2
    return x[:, :half], x[:, half:]


def _pick(early, a, b):
    """`a` on the devices where `early` holds, else `b` (same shapes)."""
    return jax.tree.map(lambda a, b: jnp.where(early, a, b), a, b)


def _kept(partial, keep):
    """A partial result, or (where `keep` is false) the empty one that merging leaves out."""
    out, lse = partial
    return jnp.where(keep, out, 0.0), jnp.where(keep, lse, _MASKED)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _ring(axis, n, window, scale, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    """Ring attention of this device's queries over every device's keys (inside `shard_map`,
    rows in zigzag order: see `zigzag_rows`): `[B, L, N, Hv]` in q's dtype. A custom VJP, so the
    backward pass keeps only this device's q, k, v, output and log-normaliser: it passes the
    keys around the ring again, with their gradient accumulators, and each hop adds its part
    (`flash_grads`).

    Device d holds chunks d and 2n-1-d of every row. Its own keys: the causal tiles of both
    chunks (`causal_order`). The keys of device s != d: if s < d, chunk s is before both of
    d's chunks and chunk 2n-1-s after both, so all of d's queries see chunk s only; if s > d,
    only d's second chunk sees anything, and it sees both of s's chunks. Either way one chunk
    pair of each kind: two `[L/2, L/2]` tiles per hop on every device, the causal half of the
    full `[L, L]`."""
    out = _ring_forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, axis, n, window, scale)[0]
    return out.astype(q.dtype)


def _ring_forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, axis, n, window, scale):
    ring = [(i, (i + 1) % n) for i in range(n)]
    attend = functools.partial(flash_partial, window=window, scale=scale)
    me = jax.lax.axis_index(axis)
    qa, qb = zip(*map(_halves, (q, q_pos, q_seg)), strict=True)

    def tile(queries, keys):
        (q, q_pos, q_seg), (k, v, kv_pos, kv_seg) = queries, keys
        return attend(q, k, v, q_pos, kv_pos, q_seg, kv_seg)

    def hop(carry, t):
        (a, b), shard = carry
        shard = jax.lax.ppermute(shard, axis, ring)
        early = (me - t) % n < me  # the keys came from a device before this one
        first, second = zip(*map(_halves, shard), strict=True)
        o1 = tile(_pick(early, qa, qb), first)
        o2 = tile(qb, _pick(early, first, second))
        a = merge_partials(*a, *_kept(o1, early))
        b = merge_partials(*merge_partials(*b, *o2), *_kept(o1, ~early))
        return ((a, b), shard), None

    own = attend(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal_order=True)
    init = (tuple(zip(*map(_halves, own), strict=True)), (k, v, kv_pos, kv_seg))
    ((a, b), _), _ = jax.lax.scan(hop, init, jnp.arange(1, n))
    return tuple(jnp.concatenate(x, axis=1) for x in zip(a, b, strict=True))


def _ring_fwd(axis, n, window, scale, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    out, lse = _ring_forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, axis, n, window, scale)
    out = _checkpoint_name(out.astype(q.dtype), "context_attention")
    lse = _checkpoint_name(lse, "context_attention")
    return out, (q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse)


def _ring_bwd(axis, n, window, scale, residuals, d_out):
    q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse = residuals
    ring = [(i, (i + 1) % n) for i in range(n)]
    d_out = d_out.astype(jnp.float32)
    grads = functools.partial(flash_grads, window=window, scale=scale)
    me = jax.lax.axis_index(axis)
    rows = (q, q_pos, q_seg, lse, d_out, output_dot(d_out, out))  # (the per-query inputs)
    qa, qb = zip(*map(_halves, rows), strict=True)

    def tile(qs, keys):
        q, q_pos, q_seg, lse, d_out, d_mass = qs
        k, v, kv_pos, kv_seg = keys
        return grads(q, k, v, q_pos, kv_pos, q_seg, kv_seg, lse, d_out, d_mass)

    def hop(carry, t):
        (dqa, dqb), shard = carry
        shard = jax.lax.ppermute(shard, axis, ring)
        keys, (dk, dv) = shard[:4], shard[4:]
        early = (me - t) % n < me
        first, second = zip(*map(_halves, keys), strict=True)
        dq1, dk1, dv1 = tile(_pick(early, qa, qb), first)
        dq2, dkz, dvz = tile(qb, _pick(early, first, second))
        zero = jnp.zeros_like
        dqa = dqa + jnp.where(early, dq1, 0.0)
        dqb = dqb + jnp.where(early, 0.0, dq1) + dq2
        dk = dk + jnp.concatenate([dk1 + jnp.where(early, dkz, 0.0),
                                   jnp.where(early, zero(dkz), dkz)], axis=1)  # fmt: skip
        dv = dv + jnp.concatenate([dv1 + jnp.where(early, dvz, 0.0),
                                   jnp.where(early, zero(dvz), dvz)], axis=1)  # fmt: skip
        return ((dqa, dqb), (*keys, dk, dv)), None

    dq, dk, dv = grads(q, k, v, q_pos, kv_pos, q_seg, kv_seg, lse, d_out, rows[-1],
                       causal_order=True)  # fmt: skip
    init = (_halves(dq), (k, v, kv_pos, kv_seg, dk, dv))
    ((dqa, dqb), shard), _ = jax.lax.scan(hop, init, jnp.arange(1, n))
    # After n - 1 hops each shard, with its gradient, is one hop short of its own device.
    dk, dv = jax.lax.ppermute(shard[4:], axis, ring)
    dq = jnp.concatenate([dqa, dqb], axis=1)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None)


_ring.defvjp(_ring_fwd, _ring_bwd)
