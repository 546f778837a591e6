"""Placing host data on the mesh: each process contributes its own rows."""

from __future__ import annotations

import jax
import numpy as np

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
