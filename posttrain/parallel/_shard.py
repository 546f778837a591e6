"""Placing host data on the mesh: each process contributes its own rows."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding

from posttrain.parallel._exchange import crossing
from posttrain.parallel._rules import LogicalAxes, named_sharding

BATCH_AXES: LogicalAxes = ("act_batch", "act_length")


def shard_batch(batch, mesh, axes: LogicalAxes = BATCH_AXES):
    """Turns a pytree of this process's numpy rows into global arrays sharded over the batch.

    Every leaf has the batch as its leading dimension; with several processes each passes only
    its own rows (`jax.make_array_from_process_local_data`), so no host holds the global batch.
    """

    def place(x):
        x = np.asarray(x)
        leaf_axes = tuple(axes[: x.ndim]) + (None,) * max(0, x.ndim - len(axes))
        global_shape = (x.shape[0] * jax.process_count(),) + x.shape[1:]
        sharding = named_sharding(leaf_axes, global_shape, mesh)
        return jax.make_array_from_process_local_data(sharding, x, global_shape)

    return jax.tree.map(place, batch)


def process_rows(rows: int, mesh, axes: LogicalAxes = BATCH_AXES) -> slice:
    """The rows of a global batch of `rows` that this process feeds with `shard_batch`."""
    sharding = named_sharding(tuple(axes[:1]), (rows,), mesh)
    starts, stops = set(), set()
    for index in sharding.addressable_devices_indices_map((rows,)).values():
        starts.add(index[0].start or 0)
        stops.add(rows if index[0].stop is None else index[0].stop)
    local = slice(min(starts), max(stops))
    if (local.stop - local.start) * jax.process_count() != rows:
        raise ValueError(
            f"this process's devices do not hold one contiguous 1/{jax.process_count()} of "
            "the batch: lay the mesh's batch axes out process by process"
        )
    return local


def put(tree, shardings):
    """`jax.device_put(tree, shardings)` that also places host values (or one process's
    device values) on shardings spanning several processes, where every process holds the
    same values: each builds its own shards of them."""

    def one(x, sharding):
        if sharding.is_fully_addressable:
            return jax.device_put(x, sharding)
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # (typed keys: their data)
            return jax.random.wrap_key_data(
                one(jax.random.key_data(x), sharding), impl=jax.random.key_impl(x)
            )
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(one, tree, shardings)


def fetch(tree):
    """`jax.device_get(tree)` that also reads arrays sharded over devices of several
    processes: those are first gathered onto every device of their mesh (one program, which
    every process must issue in the same order), so each process gets the whole values."""
    leaves = jax.tree.leaves(tree)
    spread = [
        x for x in leaves
        if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated)
    ]  # fmt: skip
    if spread:
        mesh = spread[0].sharding.mesh
        everywhere = NamedSharding(mesh, jax.sharding.PartitionSpec())
        shapes = " ".join(f"{x.dtype}{list(x.shape)}" for x in spread)
        crossing(f"gather {shapes}")
        gathered = iter(jax.jit(_identity, out_shardings=everywhere)(spread))
        tree = jax.tree.map(lambda x: next(gathered) if any(x is s for s in spread) else x, tree)
    return jax.device_get(tree)


def _identity(x):
    return x


def to_process_local(tree, shardings, stacked_mesh):
    """This process's own copy of globally sharded arrays, laid out by `shardings` (on its
    local mesh, one of `stacked_mesh`'s): one collective reshard to the same specs on the
    stacked mesh (a copy per process, device to device), then each process keeps its shards;
    no host ever holds the tree."""
    stacked = jax.tree.map(lambda s: NamedSharding(stacked_mesh, s.spec), shardings)
    crossing(f"copy per process of {len(jax.tree.leaves(tree))} arrays")
    copies = jax.device_put(tree, stacked)
    return jax.tree.map(
        lambda x, s: jax.make_array_from_single_device_arrays(
            x.shape, s, [shard.data for shard in x.addressable_shards]
        ),
        copies,
        shardings,
    )
