"""What every method's driver shares: config -> mesh, tokenizer and model; what it trains
(`Trainable`, its start from `posttrain.train._params`); resume; the jitted step; the loop.

A driver (SFT, DPO, reward model...) brings its data iterator, its loss and what it trains
(`Trainable`); `train` does the rest the same way for all of them.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from posttrain import paths
from posttrain.config import ConfigError
from posttrain.data import load_tokenizer
from posttrain.models import (
    ModelConfig,
    ModelSpec,
    param_shapes,
    param_shardings,
    param_specs,
    update_routing_bias,
    with_shardings,
)
from posttrain.parallel import axis_rules, crossing, make_mesh, shard_batch
from posttrain.train._checkpoint import Checkpointer
from posttrain.train._flags import with_chosen_flags
from posttrain.train._lock import claim, run_lock
from posttrain.train._loop import train_loop
from posttrain.train._optimizer import learning_rate_schedule, make_optimizer
from posttrain.train._params import check_same_model, start_params, to_json
from posttrain.train._state import create_state, state_shardings
from posttrain.train._step import (
    EXPERT_COUNTS,
    BatchPasses,
    LossFn,
    PostUpdate,
    passes_step,
    train_step,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Trainable:
    """What a method trains: the params' shapes, shardings, weight-decay mask, and how to make
    their starting values (called only when there is no checkpoint to resume)."""

    shapes: Any
    shardings: Any
    decay_mask: Any
    init: Callable[[], Any]
    post_update: PostUpdate | None = None  # see `train_step`
    frozen: Any = None  # bools like `shapes`: True = held fixed (`ModelSpec.freeze`)


def routing_bias_update(model_config: ModelConfig) -> PostUpdate | None:
    """DeepSeek-V3's aux-loss-free balancing after each step (`MoEConfig.routing_bias_rate`),
    from the step's expert counts; None when the model has no bias to move."""
    rate = model_config.moe.routing_bias_rate if model_config.moe else 0.0
    if not rate:
        return None

    def update(params, sums):
        layers = params["layers"]
        moe = dict(layers["moe"])
        moe["routing_bias"] = update_routing_bias(moe["routing_bias"], sums[EXPERT_COUNTS], rate)
        return {**params, "layers": {**layers, "moe": moe}}

    return update


def decay_mask(model_config: ModelConfig) -> dict:
    """Weight decay on the transformer's matrices only (not norms, biases)."""
    return jax.tree.map(
        lambda s: s.init == "normal",
        param_specs(model_config),
        is_leaf=lambda x: hasattr(x, "init"),
    )


def frozen_mask(patterns: tuple[str, ...], shapes: Any) -> Any:
    """Bools like `shapes`: True where a regex of `patterns` matches the param's path
    ("vision/layers/q", "embed"); None for no patterns.

    Raises:
      ConfigError: a pattern matches no param.
    """
    if not patterns:
        return None
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    names = ["/".join(str(getattr(k, "key", k)) for k in path) for path, _ in flat]
    for pattern in patterns:
        if not any(re.search(pattern, n) for n in names):
            raise ConfigError(
                f"model.freeze: {pattern!r} matches no parameter; paths look like "
                f"{', '.join(names[:4])}, ..."
            )
    return jax.tree.unflatten(treedef, [any(re.search(p, n) for p in patterns) for n in names])


def hold_frozen(loss_fn: Callable, frozen: Any) -> Callable:
    """`loss_fn` with no gradient into the frozen params (nor the backward pass that makes it)."""
    if frozen is None:
        return loss_fn

    def held(params, batch, rng):
        params = jax.tree.map(lambda p, f: jax.lax.stop_gradient(p) if f else p, params, frozen)
        return loss_fn(params, batch, rng)

    return held


def model_trainable(spec: ModelSpec, model_config: ModelConfig, mesh, seed: int) -> Trainable:
    """The transformer itself (SFT, DPO), less the params `spec.freeze` holds fixed."""
    shapes = param_shapes(model_config)
    return Trainable(
        shapes=shapes,
        shardings=param_shardings(model_config, mesh),
        decay_mask=decay_mask(model_config),
        init=lambda: start_params(spec, model_config, mesh, seed),
        post_update=routing_bias_update(model_config),
        frozen=frozen_mask(spec.freeze, shapes),
    )


def check_batching(batch_size: int, micro_batches: int, mesh) -> None:
    sizes = dict(mesh.shape)
    data_parallel = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    if batch_size % micro_batches:
        raise ConfigError(
            f"data.batch_size={batch_size} is not divisible by train.micro_batches={micro_batches}"
        )
    if (batch_size // micro_batches) % data_parallel:
        raise ConfigError(
            f"each micro-batch has {batch_size // micro_batches} rows, not divisible by the "
            f"data-parallel size {data_parallel} (mesh data x fsdp x expert); make "
            f"data.batch_size a multiple of {data_parallel * micro_batches}"
        )


def setup(config, workdir: str, rows: int | None = None, devices=None):
    """Checks and loads what every method needs: (mesh, tokenizer, model_config).

    `config` has `mesh`, `data`, `train`, `tokenizer` and `model` (a `ModelSpec`); `rows` is
    the rows of one optimizer update (default `data.batch_size`); `devices` those the run
    trains on (default all). Everything that can be wrong is reported before any compile,
    and before anything is written (a workdir holding another model's checkpoints is refused).

    First takes the workdir's lock (`WorkdirBusyError` while another run holds it), which the
    `train` that follows releases.
    """
    claim(workdir)
    mesh = make_mesh(config.mesh, devices)
    check_batching(rows or config.data.batch_size, config.train.micro_batches, mesh)
    tokenizer_dir = config.tokenizer or config.model.hf_path
    if not tokenizer_dir:
        raise ConfigError("tokenizer: set it to a tokenizer directory (or set model.hf_path)")
    tokenizer = load_tokenizer(tokenizer_dir)
    model_config = config.model.model_config()
    if tokenizer.vocab_size > model_config.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's "
            f"vocab_size is {model_config.vocab_size}"
        )
    check_same_model(workdir, model_config)  # before `train` rewrites config.json
    return mesh, tokenizer, model_config


def optimizer_and_abstract_state(config, trainable: Trainable, updates: int | None = None):
    """The run's optimizer (its schedule spans `updates`, default `train.steps`) and the
    shapes of its train state."""
    updates = updates or config.train.steps
    optimizer = make_optimizer(config.optimizer, updates, trainable.decay_mask, trainable.frozen)
    abstract = jax.eval_shape(
        functools.partial(create_state, optimizer=optimizer, seed=config.train.seed),
        trainable.shapes,
    )
    return optimizer, abstract


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One method's train step, as both a run and `posttrain compile` build it: what it trains,
    its loss (`frozen -> loss_fn`, called inside the jitted step with the named frozen inputs,
    such as a LoRA run's `{"base": ...}` or DPO's `{"reference": ...}`, so that they are
    traced arguments with their own shardings, not constants baked into the executable), and
    how each batch is used."""

    trainable: Trainable
    loss: Callable[[dict], LossFn]
    passes: BatchPasses = BatchPasses()


def make_step(config, plan: StepPlan, mesh):
    """`(step, optimizer, abstract state, state shardings)`: the unjitted
    `step(state, frozen inputs {name: array}, batch) -> (state, metrics)` of `plan` under
    `config`'s optimizer (its schedule spans every update), micro-batches and the trainable's
    `post_update`. A run jits it (`train`); `posttrain compile` lowers the same function."""
    passes = plan.passes
    updates = config.train.steps * passes.updates
    optimizer, abstract = optimizer_and_abstract_state(config, plan.trainable, updates)
    schedule = learning_rate_schedule(config.optimizer, updates)
    shardings = state_shardings(optimizer, abstract, plan.trainable.shardings, mesh)

    def step(state, inputs, batch):
        kwargs = dict(
            loss_fn=hold_frozen(plan.loss(inputs), plan.trainable.frozen),
            optimizer=optimizer,
            schedule=schedule,
            micro_batches=config.train.micro_batches,
            post_update=plan.trainable.post_update,
        )
        if passes.updates == 1:
            return train_step(state, batch, **kwargs)
        return passes_step(state, batch, passes=passes, **kwargs)

    return step, optimizer, abstract, shardings


def train(
    config,
    workdir: str,
    *,
    mesh,
    plan: StepPlan,
    data,
    loss_inputs: dict | None = None,
    loss_input_shardings: dict | None = None,
    evaluate: Callable | None = None,
    extras: dict | None = None,
    flops_per_token: float | None = None,
    on_metrics=None,
    eval_first: bool = False,
) -> dict:
    """Resumes (or starts) the run in `workdir` and trains it to `config.train.steps`, holding
    the workdir's lock (`WorkdirLock`, taken by `setup` or here) until it returns or raises.

    Args:
      config: the method's config (`optimizer`, `train`, `checkpoint`, `mesh`, `data`).
      workdir: the run directory.
      mesh: the device mesh.
      plan: the step (what is trained, the loss, how each batch is used: see `make_step`).
      data: this process's batch iterator, with get_state/set_state (a source that samples
        with the trained model, such as RL's, also observes each new state: see `train_loop`).
      loss_inputs, loss_input_shardings: the loss's named frozen inputs and their shardings.
      evaluate: `state -> eval metrics` (its `eval_loss` ranks checkpoints for keep-best).
      extras: JSON items saved with every checkpoint (config, model_config, manifest...).
      flops_per_token: for the MFU estimate.
      on_metrics: `(step, metrics)` callback.
      eval_first: a fresh run also evaluates its starting params (step 0).

    Returns:
      The loop summary plus `state` (the final train state), `data` (the data stats), and
      what ran: `step` (the jitted `(state, loss_inputs, batch)` function), `loss_inputs` and
      `batch_shapes` (the first global batch's shapes and dtypes).
    """
    loss_inputs = dict(loss_inputs or {})
    with run_lock(workdir), axis_rules(config.mesh.axis_rules), jax.set_mesh(mesh):
        # Written once the method has checked its config and data (nothing before it writes).
        paths.write_text(paths.join(workdir, "config.json"), json.dumps(to_json(config), indent=2))
        step, optimizer, abstract, shardings = make_step(config, plan, mesh)
        checkpointer = Checkpointer(workdir, config.checkpoint)
        restored = checkpointer.restore(with_shardings(abstract, shardings))
        if restored is not None:
            resumed, state, data_state, _ = restored
            if data_state is not None:
                data.set_state(data_state)
            log.info(
                "resumed from step %d (%s); metrics.jsonl keeps its lines up to that step",
                resumed,
                checkpointer.directory / str(resumed),
            )
        else:
            state = jax.jit(
                functools.partial(create_state, optimizer=optimizer, seed=config.train.seed),
                out_shardings=shardings,
            )(plan.trainable.init())
        jitted = jax.jit(
            step,
            in_shardings=(shardings, dict(loss_input_shardings or {}), None),
            out_shardings=(shardings, None),
            donate_argnums=0,
        )
        step_fn = with_chosen_flags(jitted)  # (on TPU: the flags `posttrain compile` chose)
        with checkpointer.settled():
            state, summary = train_loop(
                state=state,
                step_fn=lambda state, batch: step_fn(state, loss_inputs, batch),
                data=data,
                mesh=mesh,
                workdir=workdir,
                loop=config.train,
                checkpointer=checkpointer,
                evaluate=evaluate,
                checkpoint_json=extras,
                flops_per_token=flops_per_token,
                on_metrics=on_metrics,
                updates_per_step=plan.passes.updates,
                eval_first=eval_first,
            )
        checkpointer.close()
    summary["data"] = dict(getattr(data, "stats", {}) or {})
    if hasattr(data, "log_stats"):  # one line per source that cut or left out records
        data.log_stats("at the end of the run")
    summary.update(state=state, step=jitted, loss_inputs=loss_inputs)
    return summary


def each_batch(batches, mesh, max_batches: int = 0):
    """Sharded global batches of a finite stream, every process stepping together.

    Processes' shards can end after different numbers of batches: each process then feeds
    all-empty batches (no loss tokens, no pairs) until every process is done, so collective
    steps never hang. Yields `(global batch, real)`, `real` False for this process's fillers.
    """
    empty = None
    for i in itertools.count():
        if max_batches and i >= max_batches:
            return
        batch = next(batches, None)
        if jax.process_count() > 1:
            crossing("whether every process's batches ended")
            done = multihost_utils.process_allgather(np.asarray(batch is None))
            if np.all(done):
                return
        elif batch is None:
            return
        real = batch is not None
        batch = batch if real else empty
        empty = jax.tree.map(np.zeros_like, batch)
        yield shard_batch(batch, mesh), real


def summed(step, params, batches, mesh, max_batches: int = 0) -> dict[str, float]:
    """`step(params, batch) -> sums`, added up over a finite stream on every process."""
    totals: dict[str, float] = {}
    for batch, _ in each_batch(batches, mesh, max_batches):
        for k, v in jax.device_get(step(params, batch)).items():
            if np.ndim(v) == 0:  # (not the MoE expert counts)
                totals[k] = totals.get(k, 0.0) + float(v)
    return totals


def local_rows(x: jax.Array, mesh) -> np.ndarray:
    """This process's rows of a batch-sharded global array (those it fed with `shard_batch`)."""
    if jax.process_count() == 1:
        return np.asarray(jax.device_get(x))
    spec = jax.sharding.PartitionSpec(*x.sharding.spec)
    return np.asarray(multihost_utils.global_array_to_host_local_array(x, mesh, spec))
