"""The train step: a pure function `(state, batch) -> (state, metrics)` shared by every method.

Methods differ only in `loss_fn(params, batch, rng) -> sums`, which returns summed quantities
including `loss_sum` (differentiated) and `num_tokens` (the normaliser: loss tokens for SFT,
pairs for DPO...). Micro-batches and data-parallel shards add their sums; the step divides once
by the global count, so accumulation and sharding never change the update. Every other `X_sum`
becomes the metric `X`: divided by `num_tokens`, or by `X_count` where the loss returns one (a
group's mean, such as one domain's accuracy `accuracy/math_sum` / `accuracy/math_count`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from posttrain.parallel import constrain
from posttrain.train._state import TrainState

LossFn = Callable[[dict, dict, jax.Array], dict[str, jax.Array]]
PostUpdate = Callable[[dict, dict], dict]

EXPERT_COUNTS = "moe/expert_counts"


def add_moe_aux(sums: dict, aux: dict) -> dict:
    """A loss function's sums plus the MoE auxiliary loss and its metrics (see
    `posttrain.models._moe.moe_aux`); unchanged for a dense model (empty `aux`).

    The auxiliary loss is a mean over the micro-batch's tokens, so it enters `loss_sum` times
    the micro-batch's normaliser and averages like the loss. The expert counts `[T, E]` become
    `moe/load_max|min` (an expert's tokens over the layer's mean, extremes over layers) and
    `moe/tokens/<e>` (tokens routed to expert e, summed over layers) in `train_step`.
    """
    if not aux:
        return sums
    n = sums["num_tokens"]
    sums = dict(sums, loss_sum=sums["loss_sum"] + aux["loss"] * n)
    for name in ("aux_loss", "z_loss", "dropped_fraction"):
        sums[f"moe/{name}_sum"] = jax.lax.stop_gradient(aux[name]) * n
    sums[EXPERT_COUNTS] = aux["expert_counts"].astype(jnp.float32)
    return sums


def _expert_metrics(counts_TE: jax.Array) -> dict:
    load_TE = counts_TE / jnp.maximum(jnp.mean(counts_TE, axis=-1, keepdims=True), 1e-9)
    metrics = {"moe/load_max": jnp.max(load_TE), "moe/load_min": jnp.min(load_TE)}
    for e, tokens in enumerate(jnp.sum(counts_TE, axis=0)):
        metrics[f"moe/tokens/{e}"] = tokens
    return metrics


def split_micro_batches(batch: dict, num: int) -> dict:
    """`[B, ...] -> [num, B/num, ...]`, taking every num-th row so each device's rows stay local."""

    def split(x):
        if x.shape[0] % num:
            raise ValueError(f"batch of {x.shape[0]} rows does not split into {num} micro-batches")
        micro = x.reshape(x.shape[0] // num, num, *x.shape[1:]).swapaxes(0, 1)
        return constrain(micro, (None, "act_batch") + (None,) * (x.ndim - 1))

    return jax.tree.map(split, batch)


def train_step(
    state: TrainState,
    batch: dict,
    *,
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule | None = None,
    micro_batches: int = 1,
    post_update: PostUpdate | None = None,
) -> tuple[TrainState, dict]:
    """One optimizer update from `batch` (the global batch, sharded over the data axes).

    Non-finite loss, gradients, update (a learning rate that overflows) or updated params skip
    the update (params and optimizer state unchanged) and count it in `bad_steps` (consecutive) and
    `skipped_steps` (total); the loop decides when to stop. `post_update(params, sums) ->
    params` changes the updated params outside the optimizer (the MoE routing bias). A batch
    with `update_scale` (one per row) scales the update by its mean, as a learning-rate
    multiplier would.
    """
    rng, step_rng = jax.random.split(state.rng)
    micro = split_micro_batches(batch, micro_batches)
    rngs = jax.random.split(step_rng, micro_batches)

    def accumulate(carry, xs):
        grads_acc, sums_acc = carry
        micro_batch, micro_rng = xs

        def objective(params):
            sums = loss_fn(params, micro_batch, micro_rng)
            return sums["loss_sum"], sums

        grads, sums = jax.grad(objective, has_aux=True)(state.params)
        grads = jax.tree.map(lambda a, g: a + g.astype(a.dtype), grads_acc, grads)
        # Sums add up over micro-batches; an "X_max" keeps the largest.
        sums = {k: (jnp.maximum if k.endswith("_max") else jnp.add)(sums_acc[k], v)
                for k, v in sums.items()}  # fmt: skip
        return (grads, sums), None

    sums_shape = jax.eval_shape(loss_fn, state.params, jax.tree.map(lambda x: x[0], micro), rngs[0])
    zero_sums = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), sums_shape)
    zero_grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
    (grads, sums), _ = jax.lax.scan(accumulate, (zero_grads, zero_sums), (micro, rngs))

    denom = jnp.maximum(sums["num_tokens"], 1.0)
    grads = jax.tree.map(lambda g: g / denom, grads)
    loss = sums["loss_sum"] / denom
    grad_norm = optax.global_norm(grads)
    updates, new_opt_state = optimizer.update(grads, state.opt_state, state.params)
    if "update_scale" in batch:  # a per-row learning-rate multiplier (RL's domains.lr_scale)
        scale = jnp.mean(batch["update_scale"])
        updates = jax.tree.map(lambda u: (u * scale).astype(u.dtype), updates)
    new_params = optax.apply_updates(state.params, updates)
    if post_update is not None:
        new_params = post_update(new_params, sums)
    # Finite gradients can still make non-finite params (an inf learning rate, post_update).
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(optax.global_norm(updates))
    for leaf in jax.tree.leaves(new_params):
        finite &= jnp.all(jnp.isfinite(leaf))
    keep = lambda new, old: jnp.where(finite, new, old)
    new_state = state.replace(
        step=state.step + 1,
        params=jax.tree.map(keep, new_params, state.params),
        opt_state=jax.tree.map(keep, new_opt_state, state.opt_state),
        rng=rng,
        bad_steps=jnp.where(finite, 0, state.bad_steps + 1),
        skipped_steps=state.skipped_steps + (~finite).astype(jnp.int32),
    )
    metrics = {
        "loss": loss,
        "grad_norm": grad_norm,
        "param_norm": optax.global_norm(new_state.params),
        "bad_step": (~finite).astype(jnp.int32),
        "skipped_steps": new_state.skipped_steps,
        "bad_steps": new_state.bad_steps,
    }
    if EXPERT_COUNTS in sums:
        metrics.update(_expert_metrics(sums[EXPERT_COUNTS]))
    for name, value in sums.items():
        if name in ("loss_sum", EXPERT_COUNTS) or name.endswith("_count"):
            continue
        if not name.endswith("_sum"):
            metrics[name] = value
            continue
        base = name[: -len("_sum")]
        if (count := sums.get(f"{base}_count")) is None:
            metrics[base] = value / denom
        else:  # a group's mean (e.g. one domain's accuracy): NaN when the batch has none of it
            metrics[base] = jnp.where(count > 0, value / jnp.maximum(count, 1.0), jnp.nan)
    if schedule is not None:
        metrics["learning_rate"] = schedule(state.step)
    return new_state, metrics


@dataclasses.dataclass(frozen=True)
class BatchPasses:
    """How one loop step uses its batch: `epochs` passes, each of `minibatches` optimizer updates
    on every minibatches-th row (PPO's reuse of one rollout batch); (1, 1) is `train_step`."""

    epochs: int = 1
    minibatches: int = 1

    @property
    def updates(self) -> int:
        return self.epochs * self.minibatches


def passes_step(
    state: TrainState, batch: dict, *, passes: BatchPasses, **step_kwargs
) -> tuple[TrainState, dict]:
    """`passes.updates` successive `train_step`s over the mini-batches of `batch` (a scan, so
    compile time does not grow with them); `step_kwargs` are `train_step`'s.

    Metrics: the first update's (the policy that produced the batch: on-policy), with the last
    update's `grad_norm`, `param_norm`, step counters and loss (`loss_last_update`).
    """
    minis = split_micro_batches(batch, passes.minibatches)

    def update(state, i):
        mini = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), minis)
        return train_step(state, mini, **step_kwargs)

    order = jnp.arange(passes.updates, dtype=jnp.int32) % passes.minibatches
    state, stacked = jax.lax.scan(update, state, order)
    metrics = {k: v[0] for k, v in stacked.items()}
    for name in ("grad_norm", "param_norm", "bad_step", "skipped_steps", "bad_steps"):
        metrics[name] = stacked[name][-1]
    metrics["loss_last_update"] = stacked["loss"][-1]
    return state, metrics
