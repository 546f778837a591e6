"""Pipeline parallelism: the scanned layer stack split over the `stage` mesh axis (GPipe).

With `mesh.ici.stage = S` (or `mesh.dcn.stage`: stages on different slices, where only
activations cross the slow links), the layer stack's leading axis is sharded S ways (the
`layers` rule), so each stage holds T / S consecutive layers. A training forward splits the
batch into M microbatches (row r in microbatch r mod M) and runs M + S - 1 ticks: at tick t
stage s applies its layers to microbatch t - s (the first stage reads it from the batch, the
others receive it from the stage before with a `ppermute`), and the last stage keeps the
results, which a `psum` over stages then gives every device. Autodiff runs the same schedule
backwards (the transpose of each `ppermute` sends gradients to the stage before). Ticks where
a stage has no microbatch are the bubble: (S - 1) / (M + S - 1) of the step, reported by
`posttrain compile`.

What the backward keeps (`model.pipeline_remat`): "layers" keeps what each layer's `remat`
policy saves for every microbatch until the backward reaches it, so a stage holds its layers'
residuals for all M microbatches at once; "stage" keeps only each microbatch's input to the
stage and reruns the stage's layers for one microbatch at a time in the backward (the GPipe
paper's re-materialisation at partition boundaries): the layers' residuals of one microbatch
are live at a time, for one more forward of the stage. The layers inside the rerun still save
what `remat` says: `remat="none"` with "stage" runs the forward twice (no nested remat).

A MoE stack's per-layer aux (routing, expert counts, balance losses) comes back as one pass
over every row gives it, except the balance and z losses: each microbatch's, averaged.

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


def pipeline_layers(build, x_BLD, xs, side, *, microbatches: int = 0, remat: str = "layers"):
    """Applies a layer stack over the stages of the current mesh (see the module docstring).

    Args:
      build: `build(*side) -> layer`, `layer(x, *one_layer_xs) -> (x, (cache, aux))` for rows
        whose per-row inputs (positions, segment ids, RoPE angles...) are `side`.
      x_BLD: the stack's input, every row.
      xs: the per-layer inputs, stacked on a leading layer axis (params, window indices...).
      side: a tuple of per-row arrays `[B, ...]`.
      microbatches: M; 0 means one per stage.
      remat: "layers" or "stage", what the backward keeps (see the module docstring).

    Returns:
      The stack's output `[B, L, D]` and its layers' aux (a MoE stack's routing: `{}` for a
      dense one), stacked over the layers as a scan over them gives it.
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
        # Microbatch m is rows m, m + M, m + 2M, ...: rows split over the batch axes stay on
        # their devices, each holding its share of every microbatch (contiguous microbatches
        # would sit on a few devices and move at every tick).
        split = lambda a: a.reshape(B // M, M, *a.shape[1:]).swapaxes(0, 1)  # noqa: E731
        x_M, side_M = split(x), jax.tree.map(split, side)

        def run_stage(h, xs, side_m):  # (output, the stage's layers' aux `[T / S, ...]`)
            layer = build(*side_m)
            return jax.lax.scan(lambda h, layer_xs: _out_and_aux(layer(h, *layer_xs)), h, xs)

        if remat == "stage":  # keep the stage's input; rerun its layers in the backward
            run_stage = jax.checkpoint(
                run_stage, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False
            )

        def tick(carry, t):
            incoming, out_M = carry
            m = jnp.clip(t - stage, 0, M - 1)  # the microbatch this stage works on
            h = jnp.where(stage == 0, x_M[jnp.clip(t, 0, M - 1)], incoming)
            y, aux = run_stage(h, xs, jax.tree.map(lambda a: a[m], side_M))
            last = (stage == S - 1) & (t - stage >= 0) & (t - stage < M)
            out_M = out_M.at[m].set(jnp.where(last, y, out_M[m]))
            return (jax.lax.ppermute(y, "stage", forward), out_M), aux

        init = (jnp.zeros_like(x_M[0]), jnp.zeros_like(x_M))
        (_, out_M), aux_ticks = jax.lax.scan(tick, init, jnp.arange(M + S - 1))
        out_M = jax.lax.psum(jnp.where(stage == S - 1, out_M, jnp.zeros_like(out_M)), "stage")
        # This stage worked on microbatch m at tick s + m.
        aux_M = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, stage, M), aux_ticks)
        aux_T = {k: _combine(k, a) for k, a in aux_M.items()}
        return out_M.swapaxes(0, 1).reshape(x.shape), aux_T

    P = PartitionSpec
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(), P("stage"), P()),
        out_specs=(P(), P("stage")),  # each stage's layers' aux: `[T, ...]` over the stages
        axis_names={"stage"},
        check_vma=False,
    )(x_BLD, xs, side)


# A MoE layer's aux (posttrain.models._moe.route): per-row routing kept for every row, expert
# counts summed over the microbatches, the losses and the dropped share averaged over them (as
# over `train.micro_batches`: the balance loss is each microbatch's).
_PER_ROW = ("routed_experts",)
_SUMMED = ("expert_counts",)


def _out_and_aux(layer_out):
    """A layer's `(x, (cache, aux))` as a scan step's `(x, aux)`."""
    x, (_, aux) = layer_out
    return x, aux


def _combine(key, aux_M):
    """A stage's layers' aux of each microbatch `[M, T / S, ...]` as one pass over every row
    would give it: per-row values back in row order (row r in microbatch r mod M), counts
    summed, the rest averaged."""
    if key in _PER_ROW:  # [M, T / S, B / M, ...] -> [T / S, B, ...]
        aux_M = jnp.moveaxis(aux_M, 0, 2)
        return aux_M.reshape(aux_M.shape[0], -1, *aux_M.shape[3:])
    return jnp.sum(aux_M, 0) if key in _SUMMED else jnp.mean(aux_M, 0)
