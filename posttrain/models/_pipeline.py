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

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec


def stage_count() -> int:
    """The `stage` axis size of the current mesh (1 outside a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get("stage", 1)


def loss_row_groups(config) -> int:
    """How many groups of rows a loss tail sees at a time (`hidden_states(tail=...)`): a 1F1B
    pipeline's microbatches (row r in group r mod M), else 1 (every row at once)."""
    S = stage_count()
    if S == 1 or config.pipeline_schedule != "1f1b":
        return 1
    return config.pipeline_microbatches or S


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The share of a pipelined step's ticks in which a stage idles, GPipe's or 1F1B's
    (microbatches 0: one per stage, as `pipeline_layers` runs them)."""
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
    _check_split(B, M, T, S)
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


def pipeline_loss(
    build,
    x_BLD,
    xs,
    side,
    rows,
    tail,
    tail_params,
    *,
    aux_weight=None,
    microbatches: int = 0,
    remat: str = "layers",
):
    """The sums `tail` gives over every row after the layer stack, with the stack pipelined
    in a one-forward-one-backward (1F1B) schedule when differentiated.

    `tail(tail_params, hidden_bLD, rows_b) -> sums` (a dict of scalars) is the rest of the
    loss for a group of rows: the stack's output for them and their slice of `rows` (per-row
    arrays `[B, ...]`); its sums must add over row groups (an "X_max" keeps the largest). Only
    `sums["loss_sum"]` carries gradients: the others (metrics, counts) come out as constants.

    Differentiated, the schedule runs M + 2S - 2 ticks: at tick t stage s runs the forward of
    microbatch t - s and the backward of microbatch t - 2S + 2 + s, the last stage taking the
    tail's gradient in the tick of its forward; the first S - 1 ticks hold forwards only and
    the last S - 1 backwards only, so the step costs GPipe's (S - 1)(F + B) of bubble. Each
    stage keeps its layers' residuals for at most 2S - 1 microbatches (GPipe keeps all M), and
    the gradients come out of the schedule itself (a `custom_vjp` whose backward scales them
    by the loss's cotangent).
    Undifferentiated, it is `pipeline_layers` followed by the tail over every row.

    A MoE stack's balance losses enter the loss as their mean over layers and microbatches
    times `aux_weight` (the loss's token count: `add_moe_aux`), so the schedule takes their
    gradient at that weight in each microbatch's backward; the aux it returns (as
    `pipeline_layers` gives it) carries no gradient.

    Args: as `pipeline_layers`, plus `rows`, `tail`, `tail_params` (the head's weights) and
      `aux_weight` (a MoE stack's).
    Returns: the tail's sums over every row, and the stack's aux as `pipeline_layers`'.
    """
    S = stage_count()
    M = microbatches or S
    T = jax.tree.leaves(xs)[0].shape[0]
    _check_split(x_BLD.shape[0], M, T, S)
    # Only float inputs have gradients: the rest (window indices, quantised weights) ride
    # along as constants.
    float_xs, other_xs, merge_xs = _by_dtype(xs)
    float_tp, other_tp, merge_tp = _by_dtype(tail_params)
    # Each layer's balance loss of each microbatch, in the loss: mean over T layers and M.
    aux_scale = jnp.zeros((), jnp.float32) if aux_weight is None else aux_weight / (T * M)

    @jax.custom_vjp
    def loss(x, float_xs, float_tp, other_xs, other_tp, side, rows, aux_scale):
        xs = merge_xs(float_xs, other_xs)
        out, aux = pipeline_layers(build, x, xs, side, microbatches=M, remat=remat)
        return tail(merge_tp(float_tp, other_tp), out, rows), aux

    def fwd(x, float_xs, float_tp, other_xs, other_tp, side, rows, aux_scale):
        # Gradients only for the weights being trained (LoRA's frozen base, a frozen head:
        # constants like the integer leaves).
        value = lambda tree: jax.tree.map(lambda p: p.value, tree)  # noqa: E731
        trained = lambda leaves: [p.perturbed for p in leaves]  # noqa: E731
        xs_mask, tp_mask = trained(float_xs), trained(float_tp)
        d_xs, c_xs, merge_d_xs = _partition(
            merge_xs(value(float_xs), value(other_xs)), merge_xs(xs_mask, [False] * len(other_xs))
        )
        d_tp, c_tp, merge_d_tp = _partition(merge_tp(value(float_tp), value(other_tp)),
                                            merge_tp(tp_mask, [False] * len(other_tp)))  # fmt: skip
        out, (g_x, g_dxs, g_dtp) = _one_f_one_b(
            build, value(x), d_xs, d_tp, c_xs, c_tp, value(side), value(rows),
            value(aux_scale), merge_d_xs, merge_d_tp, tail, M=M, remat=remat,
        )  # fmt: skip
        # Back to one cotangent per float input (zeros, never used, where none is needed).
        expand = lambda mask, grads, values: [  # noqa: E731
            next(grads) if m else jnp.zeros_like(v) for m, v in zip(mask, values, strict=True)
        ]
        g_xs = expand(xs_mask, iter(g_dxs), value(float_xs))
        g_tp = expand(tp_mask, iter(g_dtp), value(float_tp))
        return out, (g_x, g_xs, g_tp)

    def bwd(grads, cts):
        # (The other sums and the aux come out under a stop_gradient: no cotangent.)
        scale = cts[0]["loss_sum"]
        if isinstance(scale, jax.custom_derivatives.SymbolicZero):
            scale = jnp.zeros((), jnp.float32)
        g_x, g_xs, g_tp = jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)
        return g_x, g_xs, g_tp, None, None, None, None, None

    loss.defvjp(fwd, bwd, symbolic_zeros=True)
    sums, aux = loss(x_BLD, float_xs, float_tp, other_xs, other_tp, side, rows, aux_scale)
    sums = {k: v if k == "loss_sum" else jax.lax.stop_gradient(v) for k, v in sums.items()}
    return sums, jax.lax.stop_gradient(aux)


def _by_dtype(tree):
    """`(float leaves, other leaves, merge)`: `merge(float, other)` rebuilds the tree."""
    leaves = jax.tree.leaves(tree)
    return _partition(tree, [jnp.issubdtype(a.dtype, jnp.inexact) for a in leaves])


def _partition(tree, mask):
    """`(leaves where mask, the others, merge)`: `merge(chosen, others)` rebuilds the tree.
    `mask`: a bool per leaf, or a tree of them shaped like `tree`."""
    leaves, treedef = jax.tree.flatten(tree)
    mask = jax.tree.leaves(mask)

    def merge(chosen, others):
        ch, ot = iter(chosen), iter(others)
        return treedef.unflatten([next(ch) if m else next(ot) for m in mask])

    chosen = [a for a, m in zip(leaves, mask, strict=True) if m]
    return chosen, [a for a, m in zip(leaves, mask, strict=True) if not m], merge


def _residuals(vjp, held):
    """A `jax.vjp` function's leaves less the inputs `held` (a stage's weights, trained or
    not: held once, not per microbatch slot), and its structure: the tree and which input each
    other leaf is."""
    leaves, treedef = jax.tree.flatten(vjp)
    weights = [[i for i, w in enumerate(held) if a is w] for a in leaves]
    weights = [w[0] if w else None for w in weights]
    saved = [a for a, w in zip(leaves, weights, strict=True) if w is None]
    return saved, (treedef, weights)


def _with_residuals(structure, held, saved):
    """The VJP of `structure` (`_residuals`') at these inputs and saved residuals."""
    treedef, weights = structure
    saved = iter(saved)
    return treedef.unflatten([next(saved) if w is None else held[w] for w in weights])


def _one_f_one_b(
    build,
    x_BLD,
    float_xs,
    float_tp,
    other_xs,
    other_tp,
    side,
    rows,
    aux_scale,
    merge_xs,
    merge_tp,
    tail,
    *,
    M,
    remat,
):
    """((sums, aux), (d loss_sum / d x, d / d float_xs, d / d float_tp)) by the 1F1B
    schedule."""
    mesh = jax.sharding.get_abstract_mesh()
    S = stage_count()
    B = x_BLD.shape[0]
    K = 2 * S - 1  # residual slots: stage s has 2(S - s) - 1 microbatches in flight
    forward = [(i, i + 1) for i in range(S - 1)]
    backward = [(i + 1, i) for i in range(S - 1)]

    split = lambda a: a.reshape(B // M, M, *a.shape[1:]).swapaxes(0, 1)  # noqa: E731
    take = lambda tree, m: jax.tree.map(lambda a: a[m], tree)  # noqa: E731

    def stage_fn(side_M, other_xs, m):
        """`(float_xs, h) -> ((y, the layers' balance losses summed), their aux)`: a stage's
        layers over microbatch m's rows."""
        layer = build(*take(side_M, m))

        def run(float_xs, h):
            step = lambda h, layer_xs: _out_and_aux(layer(h, *layer_xs))  # noqa: E731
            y, aux = jax.lax.scan(step, h, merge_xs(float_xs, other_xs))
            balance = jnp.sum(aux["loss"]) if aux else jnp.zeros((), jnp.float32)
            return (y, balance), aux

        if remat == "stage":
            run = jax.checkpoint(
                run, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False
            )
        return run

    # Shapes of one microbatch's residuals on one stage, and of the tail's sums.
    stage_slice = lambda a: a[: a.shape[0] // S]  # noqa: E731
    h0 = split(x_BLD)[0]
    slot_shapes = jax.eval_shape(
        lambda fx, ox, side, h: _residuals(
            jax.vjp(stage_fn(jax.tree.map(split, side), ox, 0), fx, h, has_aux=True)[1],
            [*fx, *ox],
        )[0],
        jax.tree.map(stage_slice, float_xs), jax.tree.map(stage_slice, other_xs), side, h0,
    )  # fmt: skip
    head = lambda float_tp, h, rows: tail(merge_tp(float_tp, other_tp), h, rows)  # noqa: E731
    sums_shape = jax.eval_shape(head, float_tp, h0, take(jax.tree.map(split, rows), 0))

    def local(x, float_xs, other_xs, side, rows, float_tp, aux_scale):
        stage = jax.lax.axis_index("stage")
        last = stage == S - 1
        x_M, side_M, rows_M = split(x), jax.tree.map(split, side), jax.tree.map(split, rows)
        slots = [jnp.zeros((K, *s.shape), s.dtype) for s in slot_shapes]
        zeros = lambda tree: jax.tree.map(  # noqa: E731
            lambda s: jnp.zeros(s.shape, jnp.float32), tree
        )
        one_hot = {k: jnp.asarray(k == "loss_sum", s.dtype) for k, s in sums_shape.items()}

        def tick(carry, t, *, forwards: bool, backwards: bool):
            """Tick t: the forward of microbatch t - s, the backward of t - 2S + 2 + s (in the
            first S - 1 ticks no stage has a backward yet, in the last S - 1 none a forward:
            those ticks leave that half out, so the step costs GPipe's M + S - 1 ticks). The
            backward is the VJP this tick traced, at the saved residuals of microbatch b."""
            act_in, ct_in, slots, sums, g_xs, g_tps, g_x_M = carry
            f = t - stage  # the microbatch this stage runs forward
            b = t - 2 * S + 2 + stage  # and backward
            fc, bc = jnp.clip(f, 0, M - 1), jnp.clip(b, 0, M - 1)
            f_ok, b_ok = (f >= 0) & (f < M), (b >= 0) & (b < M)
            h = jnp.where(stage == 0, x_M[fc], act_in)
            # (In the last ticks the forward is traced for the VJP's structure only: reusing
            # the structure an earlier tick traced crashes libtpu's partitioner.)
            (y, _), vjp, aux = jax.vjp(stage_fn(side_M, other_xs, fc), float_xs, h, has_aux=True)
            saved, structure = _residuals(vjp, [*float_xs, *other_xs])
            if forwards:
                slots = [
                    s.at[f % K].set(jnp.where(f_ok, a, s[f % K]))
                    for s, a in zip(slots, saved, strict=True)
                ]
                act_in = jax.lax.ppermute(y, "stage", forward)
            if forwards and backwards:
                # The last stage: the tail's sums and gradient for the microbatch it just ran.
                # (Every stage computes it, masked: in a `lax.cond` the partitioner's
                # collectives for the head's sharded weights span all devices, and the stages
                # that skip it never join them.)
                head_f = lambda y, tp: head(tp, y, take(rows_M, fc))  # noqa: E731
                sums_f, tail_vjp = jax.vjp(head_f, y, float_tp)
                ct_y, g_tp = tail_vjp(one_hot)
                use = last & f_ok
                sums = {k: _add_sum(k, sums[k], jnp.where(use, v, 0)) for k, v in sums_f.items()}
                g_tps = jax.tree.map(lambda a, g: a + jnp.where(use, g, 0), g_tps, g_tp)
                ct_in = jnp.where(last, ct_y, ct_in)
            if backwards:
                # Backward of microbatch b, from the residuals its forward saved.
                saved = [s[b % K] for s in slots]
                vjp = _with_residuals(structure, [*float_xs, *other_xs], saved)
                g_fx, g_h = vjp((ct_in, aux_scale.astype(jnp.float32)))
                g_xs = jax.tree.map(lambda a, g: a + jnp.where(b_ok, g, 0), g_xs, g_fx)
                first = (stage == 0) & b_ok
                g_x_M = g_x_M.at[bc].set(jnp.where(first, g_h, g_x_M[bc]))
                g_h = jnp.where(b_ok, g_h, 0).astype(g_h.dtype)
                ct_in = jax.lax.ppermute(g_h, "stage", backward)
            return (act_in, ct_in, slots, sums, g_xs, g_tps, g_x_M), aux if forwards else None

        carry = (
            jnp.zeros_like(x_M[0]), jnp.zeros_like(x_M[0]), slots, zeros(sums_shape),
            zeros(float_xs), zeros(float_tp), jnp.zeros(x_M.shape, jnp.float32),
        )  # fmt: skip
        aux_ticks = []
        for ticks, forwards, backwards in [
            (range(0, S - 1), True, False),  # warm-up: forwards only
            (range(S - 1, M + S - 1), True, True),
            (range(M + S - 1, M + 2 * S - 2), False, True),  # cool-down: backwards only
        ]:
            step = functools.partial(tick, forwards=forwards, backwards=backwards)
            carry, aux = jax.lax.scan(step, carry, jnp.arange(ticks.start, ticks.stop))
            aux_ticks.append(aux)
        _, _, _, sums, g_xs, g_tps, g_x_M = carry
        # The stages' aux of each forward tick; this stage ran microbatch m at tick s + m.
        aux_ticks = jax.tree.map(lambda *a: jnp.concatenate(a), *aux_ticks[:2])
        aux_M = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, stage, M), aux_ticks)
        aux_T = {k: _combine(k, a) for k, a in aux_M.items()}
        sums = jax.tree.map(lambda a: jax.lax.psum(a, "stage"), sums)
        g_tps = jax.tree.map(lambda a: jax.lax.psum(a, "stage"), g_tps)
        g_x = jax.lax.psum(g_x_M, "stage").swapaxes(0, 1).reshape(x.shape)
        cast = lambda g, p: g.astype(p.dtype)  # noqa: E731
        grads = (cast(g_x, x), jax.tree.map(cast, g_xs, float_xs),
                 jax.tree.map(cast, g_tps, float_tp))  # fmt: skip
        return (sums, aux_T), grads

    P = PartitionSpec
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(), P("stage"), P("stage"), P(), P(), P(), P()),
        out_specs=((P(), P("stage")), (P(), P("stage"), P())),
        axis_names={"stage"},
        check_vma=False,
    )(x_BLD, float_xs, other_xs, side, rows, float_tp, aux_scale)


def _add_sum(name, a, b):
    """Two row groups' sums as one: added, or the larger for an "X_max" (as `train_step`)."""
    return jnp.maximum(a, b) if name.endswith("_max") else a + b


def _check_split(B, M, T, S):
    if B % M:
        raise ValueError(
            f"{B} rows do not split into {M} pipeline microbatches; set model."
            "pipeline_microbatches to a divisor of the rows per micro-batch"
        )
    if T % S:
        raise ValueError(f"{T} layers do not split over mesh stage={S}; use a divisor of {T}")
