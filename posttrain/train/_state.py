"""The train state: everything a step reads and writes, as one sharded pytree."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["step", "params", "opt_state", "rng", "bad_steps", "skipped_steps"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class TrainState:
    step: jax.Array  # int32, number of updates applied or skipped so far
    params: dict
    opt_state: optax.OptState
    rng: jax.Array  # PRNG key, split once per step
    bad_steps: jax.Array  # int32, consecutive steps with a non-finite loss or gradient
    skipped_steps: jax.Array  # int32, total steps whose update was skipped

    def replace(self, **changes) -> TrainState:
        return dataclasses.replace(self, **changes)


def create_state(params: dict, optimizer: optax.GradientTransformation, seed: int) -> TrainState:
    """A fresh state around `params` (jit it with out_shardings to create it sharded)."""
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=optimizer.init(params),
        rng=jax.random.key(seed),
        bad_steps=jnp.zeros((), jnp.int32),
        skipped_steps=jnp.zeros((), jnp.int32),
    )


def state_shardings(
    optimizer: optax.GradientTransformation, abstract_state: TrainState, param_shardings, mesh
) -> TrainState:
    """Shardings of every leaf: optimizer moments follow their params, scalars are replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731 (frozen params: no moments)
    opt = optax.tree_utils.tree_map_params(
        optimizer,
        lambda leaf, sharding: leaf if masked(leaf) else sharding,
        abstract_state.opt_state,
        param_shardings,
        transform_non_params=lambda _: replicated,
        is_leaf=masked,
    )
    return TrainState(
        step=replicated,
        params=param_shardings,
        opt_state=opt,
        rng=replicated,
        bad_steps=replicated,
        skipped_steps=replicated,
    )
