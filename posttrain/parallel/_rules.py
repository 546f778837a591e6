"""Logical axis names -> mesh axes: the one table that decides how everything is sharded.

Parameters and activations name their dimensions (`embed`, `heads`, `act_batch`, ...); the rules
map each name to mesh axes. A parallelism strategy is a different table, never different code.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

LogicalAxes = tuple[str | None, ...]
Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

DEFAULT_RULES: Rules = (
    # Parameters. FSDP shards the model dimension; tensor parallelism the heads and mlp.
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("experts", "expert"),
    ("q_lora", "fsdp"),  # MLA latents: where `embed` is not in the same weight
    ("kv_lora", "fsdp"),
    ("layers", "stage"),  # pipeline parallelism: each stage holds its share of the layers
    # Activations. Every data-like axis splits the batch; `sequence` splits the length.
    ("act_batch", ("data", "fsdp", "expert")),
    ("act_length", "sequence"),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)

_ACTIVE_RULES: contextvars.ContextVar[Rules] = contextvars.ContextVar(
    "posttrain_axis_rules", default=DEFAULT_RULES
)


@contextlib.contextmanager
def axis_rules(rules: Rules) -> Iterator[Rules]:
    """Makes `rules` the table used by `logical_to_spec` and `constrain` inside the block."""
    token = _ACTIVE_RULES.set(tuple(rules))
    try:
        yield rules
    finally:
        _ACTIVE_RULES.reset(token)


def current_rules() -> Rules:
    return _ACTIVE_RULES.get()


def logical_to_spec(
    axes: LogicalAxes, shape: Sequence[int] | None, mesh, rules: Rules | None = None
) -> PartitionSpec:
    """Maps logical dimension names to a PartitionSpec on `mesh`.

    A mesh axis is used at most once (first dimension wins), axes of size 1 are dropped, and when
    `shape` is given a dimension keeps only the leading mesh axes whose product divides it, so an
    8-kv-head model on tensor=16 replicates its kv heads instead of failing.
    """
    table = dict(current_rules() if rules is None else rules)
    sizes = dict(mesh.shape)
    used: set[str] = set()
    spec = []
    for dim, name in enumerate(axes):
        if name is not None and name not in table:
            raise KeyError(f"logical axis {name!r} has no sharding rule; known: {sorted(table)}")
        target = table.get(name) if name is not None else None
        mesh_axes = (target,) if isinstance(target, str) else tuple(target or ())
        chosen: list[str] = []
        for axis in mesh_axes:
            if axis in used or sizes.get(axis, 1) == 1:
                continue
            if shape is not None and shape[dim] % (
                math.prod(sizes[a] for a in chosen) * sizes[axis]
            ):
                break
            chosen.append(axis)
        used.update(chosen)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def named_sharding(
    axes: LogicalAxes, shape: Sequence[int] | None, mesh, rules: Rules | None = None
) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes, shape, mesh, rules))


def tree_shardings(axes_tree, shapes_tree, mesh, rules: Rules | None = None):
    """NamedShardings for a pytree of arrays, given the matching pytree of logical axes."""
    return jax.tree.map(
        lambda axes, x: named_sharding(axes, x.shape, mesh, rules),
        axes_tree,
        shapes_tree,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def constrain(x: jax.Array, axes: LogicalAxes) -> jax.Array:
    """Sharding constraint by logical names; a no-op outside a mesh context (`jax.set_mesh`)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(axes, x.shape, mesh))
