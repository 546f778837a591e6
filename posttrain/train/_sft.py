"""The SFT driver: config -> mesh, tokenizer, data, model, state -> the shared loop."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import os

import jax
import numpy as np
from jax.experimental import multihost_utils

from posttrain.config import ConfigError, build
from posttrain.data import DataConfig, SourceConfig, load_tokenizer, make_pipeline
from posttrain.losses import cross_entropy_sums
from posttrain.models import (
    ModelConfig,
    Transformer,
    forward,
    from_hf,
    get_preset,
    init_params,
    load_hf_config,
    param_shapes,
    param_shardings,
    param_specs,
)
from posttrain.parallel import MeshConfig, axis_rules, make_mesh, named_sharding
from posttrain.train._checkpoint import CheckpointConfig, Checkpointer
from posttrain.train._loop import LoopConfig, train_loop
from posttrain.train._optimizer import (
    OptimizerConfig,
    learning_rate_schedule,
    make_optimizer,
)
from posttrain.train._state import create_state, state_shardings
from posttrain.train._step import train_step

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Which model to train: a preset (random init) or an HF directory (its weights)."""

    preset: str = "tiny"  # posttrain.models preset name, used when hf_path is empty
    hf_path: str = ""  # HF model directory; its config.json and weights win over `preset`
    attention: str = ""  # override ModelConfig.attention ("" keeps the model's)
    remat: str = ""  # override ModelConfig.remat
    compute_dtype: str = ""  # override ModelConfig.compute_dtype
    param_dtype: str = ""  # override ModelConfig.param_dtype

    def overrides(self) -> dict:
        names = ("attention", "remat", "compute_dtype", "param_dtype")
        return {n: getattr(self, n) for n in names if getattr(self, n)}

    def model_config(self) -> ModelConfig:
        if self.hf_path:
            return load_hf_config(self.hf_path, **self.overrides())
        return get_preset(self.preset, **self.overrides())


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    model: ModelSpec = ModelSpec()
    tokenizer: str = ""  # tokenizer directory; default: model.hf_path
    data: DataConfig = None  # training data (sources, max_len, global batch size, packing)
    eval_data: tuple[SourceConfig, ...] = ()  # held-out sources for the eval loss
    optimizer: OptimizerConfig = OptimizerConfig()
    train: LoopConfig = LoopConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    mesh: MeshConfig = MeshConfig()
    z_loss: float = 0.0  # weight of the log(Z)^2 auxiliary loss

    def __post_init__(self):
        if self.data is None:
            raise ValueError("data: set data.sources to at least one training file")


def sft_loss(model_config: ModelConfig, z_loss: float):
    """`(params, batch, rng) -> sums` for the shared train step."""

    def loss_fn(params, batch, rng):
        del rng
        logits = forward(
            params, batch["tokens"], model_config, batch["positions"], batch["segment_ids"]
        )
        return cross_entropy_sums(logits, batch["targets"], batch["loss_mask"], z_loss)

    return loss_fn


def _to_json(value):
    return json.loads(json.dumps(dataclasses.asdict(value), default=str))


def _optimizer_and_abstract_state(config: SFTConfig, model_config: ModelConfig):
    """The run's optimizer (weight decay on matrices only) and its state's shapes."""
    decay_mask = jax.tree.map(
        lambda s: s.init == "normal",
        param_specs(model_config),
        is_leaf=lambda x: hasattr(x, "init"),
    )
    optimizer = make_optimizer(config.optimizer, config.train.steps, decay_mask)
    abstract = jax.eval_shape(
        functools.partial(create_state, optimizer=optimizer, seed=config.train.seed),
        param_shapes(model_config),
    )
    return optimizer, abstract


def _check_batching(config: SFTConfig, mesh) -> None:
    sizes = dict(mesh.shape)
    data_parallel = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    rows, micro = config.data.batch_size, config.train.micro_batches
    if rows % micro:
        raise ConfigError(f"data.batch_size={rows} is not divisible by train.micro_batches={micro}")
    if (rows // micro) % data_parallel:
        raise ConfigError(
            f"each micro-batch has {rows // micro} rows, not divisible by the data-parallel size "
            f"{data_parallel} (mesh data x fsdp x expert); make data.batch_size a multiple of "
            f"{data_parallel * micro}"
        )


class _Evaluator:
    """Token-weighted held-out loss over the eval sources (a fresh pass every time)."""

    def __init__(self, config: SFTConfig, tokenizer, model_config, mesh, shardings):
        self.data_config = dataclasses.replace(
            config.data, sources=config.eval_data, shuffle=False, num_epochs=1
        )
        self.tokenizer = tokenizer
        self.mesh = mesh
        self.max_batches = config.train.eval_batches
        loss_fn = sft_loss(model_config, 0.0)
        self._step = jax.jit(
            lambda params, batch: loss_fn(params, batch, None), in_shardings=(shardings, None)
        )
        make_pipeline(self.data_config, tokenizer)  # fail at startup, not at the first eval

    def __call__(self, state) -> dict:
        from posttrain.parallel import shard_batch

        totals: dict[str, float] = {}
        batches = make_pipeline(self.data_config, self.tokenizer)
        empty = None
        for i in itertools.count():
            if self.max_batches and i >= self.max_batches:
                break
            batch = next(batches, None)
            if jax.process_count() > 1:
                # Hosts' shards can end at different batch counts: every host takes part in
                # each step (an empty batch once its own data is done) until all are done.
                done = multihost_utils.process_allgather(np.asarray(batch is None))
                if np.all(done):
                    break
            elif batch is None:
                break
            if batch is None:
                batch = empty
            empty = jax.tree.map(np.zeros_like, batch)
            sums = jax.device_get(self._step(state.params, shard_batch(batch, self.mesh)))
            for k, v in sums.items():
                totals[k] = totals.get(k, 0.0) + float(v)
        n = max(totals.get("num_tokens", 0.0), 1.0)
        return {
            "eval_loss": totals.get("nll_sum", 0.0) / n,
            "eval_accuracy": totals.get("accuracy_sum", 0.0) / n,
            "eval_tokens": totals.get("num_tokens", 0.0),
        }


def run_sft(config: SFTConfig, workdir: str, *, on_metrics=None) -> dict:
    """Trains (or resumes) an SFT run in `workdir`; returns the loop summary.

    Everything that can be wrong with the config or data is reported before anything compiles.
    """
    os.makedirs(workdir, exist_ok=True)
    mesh = make_mesh(config.mesh)
    _check_batching(config, mesh)
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
    data = make_pipeline(config.data, tokenizer)
    manifest = data.manifest()
    with open(os.path.join(workdir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(_to_json(config), f, indent=2)

    with axis_rules(config.mesh.axis_rules), jax.set_mesh(mesh):
        optimizer, abstract = _optimizer_and_abstract_state(config, model_config)
        schedule = learning_rate_schedule(config.optimizer, config.train.steps)
        p_shardings = param_shardings(model_config, mesh)
        shardings = state_shardings(optimizer, abstract, p_shardings, mesh)
        checkpointer = Checkpointer(workdir, config.checkpoint)

        restored = checkpointer.restore(
            jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings
            )
        )
        if restored is not None:
            step, state, data_state, _ = restored
            if data_state is not None:
                data.set_state(data_state)
            log.info("resumed from step %d in %s", step, checkpointer.directory)
        else:
            if config.model.hf_path:
                params = from_hf(config.model.hf_path, mesh=mesh, **config.model.overrides()).params
            else:
                params = init_params(model_config, jax.random.key(config.train.seed), mesh)
            state = jax.jit(
                functools.partial(create_state, optimizer=optimizer, seed=config.train.seed),
                out_shardings=shardings,
            )(params)

        batch_sharding = named_sharding(
            ("act_batch", "act_length"), (config.data.batch_size, config.data.max_len), mesh
        )
        step_fn = jax.jit(
            functools.partial(
                train_step,
                loss_fn=sft_loss(model_config, config.z_loss),
                optimizer=optimizer,
                schedule=schedule,
                micro_batches=config.train.micro_batches,
            ),
            in_shardings=(shardings, batch_sharding),
            out_shardings=(shardings, None),
            donate_argnums=0,
        )
        evaluate = (
            _Evaluator(config, tokenizer, model_config, mesh, p_shardings)
            if config.eval_data
            else None
        )
        state, summary = train_loop(
            state=state,
            step_fn=step_fn,
            data=iter(data),
            mesh=mesh,
            workdir=workdir,
            loop=config.train,
            checkpointer=checkpointer,
            evaluate=evaluate,
            checkpoint_json={
                "config": _to_json(config),
                "model_config": _to_json(model_config),
                "manifest": manifest,
            },
            flops_per_token=model_config.flops_per_token(config.data.max_len),
            on_metrics=on_metrics,
        )
        checkpointer.close()
    summary["data"] = dict(getattr(data, "stats", {}) or {})
    summary["state"] = state
    summary["model_config"] = model_config
    return summary


def load_checkpoint_model(workdir: str, step: int | None = None) -> Transformer:
    """The model (params + config) of a run's checkpoint, on the default device."""
    checkpointer = Checkpointer(workdir, CheckpointConfig(async_save=False))
    step = step if step is not None else checkpointer.latest_step()
    if step is None:
        raise FileNotFoundError(f"no checkpoint under {checkpointer.directory}")
    saved = checkpointer.read_json(step)
    config = build(SFTConfig, saved["config"])
    model_config = build(ModelConfig, saved["model_config"])
    _, abstract = _optimizer_and_abstract_state(config, model_config)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract
    )
    _, state, _, _ = checkpointer.restore(target, step=step)
    checkpointer.close()
    return Transformer(state.params, model_config)
