"""The SFT driver: config -> mesh, tokenizer, data, model, state -> the shared loop."""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import jax

from posttrain.config import build
from posttrain.data import DataConfig, SourceConfig, make_pipeline
from posttrain.losses import cross_entropy_sums
from posttrain.models import ModelConfig, Transformer, forward, param_shapes
from posttrain.parallel import MeshConfig, axis_rules
from posttrain.train._checkpoint import CheckpointConfig
from posttrain.train._loop import LoopConfig
from posttrain.train._optimizer import OptimizerConfig
from posttrain.train._run import (
    ModelSpec,
    checkpoint_json,
    model_trainable,
    restore_params,
    setup,
    summed,
    to_json,
    train,
    with_shardings,
)
from posttrain.train._step import add_moe_aux

log = logging.getLogger(__name__)


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
        logits, aux = forward(
            params,
            batch["tokens"],
            model_config,
            batch["positions"],
            batch["segment_ids"],
            return_aux=True,
        )
        sums = cross_entropy_sums(logits, batch["targets"], batch["loss_mask"], z_loss)
        return add_moe_aux(sums, aux)

    return loss_fn


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
        batches = make_pipeline(self.data_config, self.tokenizer)
        totals = summed(self._step, state.params, batches, self.mesh, self.max_batches)
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
    mesh, tokenizer, model_config = setup(config, workdir)
    data = make_pipeline(config.data, tokenizer)
    manifest = data.manifest()
    with open(os.path.join(workdir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
    with axis_rules(config.mesh.axis_rules), jax.set_mesh(mesh):
        trainable = model_trainable(config.model, model_config, mesh, config.train.seed)
        evaluate = (
            _Evaluator(config, tokenizer, model_config, mesh, trainable.shardings)
            if config.eval_data
            else None
        )
    summary = train(
        config,
        workdir,
        mesh=mesh,
        trainable=trainable,
        data=data,
        loss=lambda: sft_loss(model_config, config.z_loss),
        evaluate=evaluate,
        extras={
            "config": to_json(config),
            "model_config": to_json(model_config),
            "manifest": manifest,
        },
        flops_per_token=model_config.flops_per_token(config.data.max_len),
        on_metrics=on_metrics,
    )
    summary["model_config"] = model_config
    return summary


def load_checkpoint_model(workdir: str, step: int | None = None) -> Transformer:
    """The model (params + config) of a run's checkpoint (SFT, DPO...), on the default device."""
    saved = checkpoint_json(workdir, step)
    model_config = build(ModelConfig, saved["model_config"])
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shapes = param_shapes(model_config)
    abstract = with_shardings(shapes, jax.tree.map(lambda _: device, shapes))
    return Transformer(restore_params(workdir, abstract, saved["step"]), model_config)
