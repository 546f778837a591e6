"""Pipeline parallelism: the scanned layer stack split over the `stage` mesh axis (GPipe).

With `mesh.ici.stage = S` (or `mesh.dcn.stage`: stages on different slices, where only
activations cross the slow links), the layer stack's leading axis is sharded S ways (the
`layers` rule), so each stage holds T / S consecutive layers. A training forward splits the
batch into M microbatches and runs M + S - 1 ticks: at tick t stage s applies its layers to
microbatch t - s (the first stage reads it from the batch, the others receive it from the stage
before with a `ppermute`), and the last stage keeps the results, which a `psum` over stages then
gives every device. Autodiff runs the same schedule backwards (the transpose of each `ppermute`
sends gradients to the stage before). Ticks where a stage has no microbatch are the bubble:
(S - 1) / (M + S - 1) of the step, reported by `posttrain compile`.

Only the stage axis is manual inside the `shard_map`; fsdp, tensor and data sharding inside a
stage stay with XLA's partitioner, so the stages compose with them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec


def stage_count() -> int:
    """The `stage` axis size of the current mesh (1 outside a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get("stage", 1)


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The share of a GPipe step's ticks in which a stage idles (microbatches 0: one per
    stage, as `pipeline_layers` runs them)."""
    microbatches = microbatches or stages
    return (stages - 1) / (microbatches + stages - 1) if stages > 1 else 0.0


def pipeline_layers(build, x_BLD, xs, side, *, microbatches: int = 0):
    """Applies a layer stack over the stages of the current mesh (see the module docstring).

    Args:
      build: `build(*side) -> layer`, `layer(x, *one_layer_xs) -> (x, (cache, aux))` for rows
        whose per-row inputs (positions, segment ids, RoPE angles...) are `side`.
      x_BLD: the stack's input, every row.
      xs: the per-layer inputs, stacked on a leading layer axis (params, window indices...).
      side: a tuple of per-row arrays `[B, ...]`.
      microbatches: M; 0 means one per stage.

    Returns:
      The stack's output `[B, L, D]`.
    """
    mesh = jax.sharding.get_abstract_mesh()
    S = stage_count()
    M = microbatches or S
    B = x_BLD.shape[0]
    T = jax.tree.leaves(xs)[0].shape[0]
    if B % M:
        raise ValueError(
            f"{B} rows do not split into {M} pipeline microbatches; set model."
            "pipeline_microbatches to a divisor of the rows per micro-batch"
        )
    if T % S:
        raise ValueError(f"{T} layers do not split over mesh stage={S}; use a divisor of {T}")
    forward = [(i, i + 1) for i in range(S - 1)]

    def local(x, xs, side):
        stage = jax.lax.axis_index("stage")
        split = lambda a: a.reshape(M, B // M, *a.shape[1:])  # noqa: E731
        x_M, side_M = split(x), jax.tree.map(split, side)

        def run_stage(h, side_m):
            layer = build(*side_m)
            return jax.lax.scan(lambda h, layer_xs: (layer(h, *layer_xs)[0], None), h, xs)[0]

        def tick(carry, t):
            incoming, out_M = carry
            m = jnp.clip(t - stage, 0, M - 1)  # the microbatch this stage works on
            h = jnp.where(stage == 0, x_M[jnp.clip(t, 0, M - 1)], incoming)
            y = run_stage(h, jax.tree.map(lambda a: a[m], side_M))
            last = (stage == S - 1) & (t - stage >= 0) & (t - stage < M)
            out_M = out_M.at[m].set(jnp.where(last, y, out_M[m]))
            return (jax.lax.ppermute(y, "stage", forward), out_M), None

        init = (jnp.zeros_like(x_M[0]), jnp.zeros_like(x_M))
        (_, out_M), _ = jax.lax.scan(tick, init, jnp.arange(M + S - 1))
        out_M = jax.lax.psum(jnp.where(stage == S - 1, out_M, jnp.zeros_like(out_M)), "stage")
        return out_M.reshape(x.shape)

    P = PartitionSpec
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(), P("stage"), P()),
        out_specs=P(),
        axis_names={"stage"},
        check_vma=False,
    )(x_BLD, xs, side)
