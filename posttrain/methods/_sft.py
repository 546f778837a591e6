"""SFT: its config, its step (`posttrain.train.sft_loss`), frozen inputs, batch, the driver
(config -> mesh, tokenizer, data, model, state -> the shared loop) and its `Method` record."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp

from posttrain import paths
from posttrain.config import ConfigError
from posttrain.data import DataConfig, SourceConfig, make_pipeline
from posttrain.eval import suite_evaluator
from posttrain.lora import LoRAConfig, Policy, merge_jit
from posttrain.methods._method import SEQUENCE, Method, abstract, images, policy_frozen
from posttrain.models import ModelConfig, ModelSpec, Transformer
from posttrain.parallel import MeshConfig, axis_rules
from posttrain.train import (
    CheckpointConfig,
    LoopConfig,
    OptimizerConfig,
    StepPlan,
    base_inputs,
    lora_json,
    policy_trainable,
    setup,
    sft_loss,
    summed,
    to_json,
    train,
)

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
    # An eval suite ("configs/eval.py:<preset>") run on the current params at every eval step,
    # logged with the eval split as suite/<category>/<task>/<metric>; "" for none.
    eval_suite: str = ""
    # LoRA adapters on the frozen `model` (only they are trained and checkpointed); None: the
    # full model is trained.
    lora: LoRAConfig | None = None

    def __post_init__(self):
        if self.data is None:
            raise ValueError("data: set data.sources to at least one training file")
        if self.eval_suite and not self.eval_data and self.checkpoint.keep_best:
            raise ConfigError(
                "eval_suite is set without eval_data, but checkpoint.keep_best ranks checkpoints "
                "by the eval loss; set eval_data or checkpoint.keep_best=0"
            )


def sft_plan(config: SFTConfig, model_config: ModelConfig, mesh) -> StepPlan:
    """SFT's step: the model (or LoRA adapters on the frozen base, the loss's one input)
    under the cross-entropy loss with `z_loss`."""

    def loss(frozen: dict):  # {"base": the frozen base} with LoRA, else {}
        policy = Policy(config.lora, frozen.get("base"))
        return sft_loss(model_config, config.z_loss, policy=policy)

    return StepPlan(policy_trainable(config, model_config, mesh), loss)


class _Evaluator:
    """Token-weighted held-out loss over the eval sources (a fresh pass every time), and the
    eval suite's metrics (`SFTConfig.eval_suite`) on the current params."""

    def __init__(
        self,
        config: SFTConfig,
        tokenizer,
        model_config,
        mesh,
        shardings,
        inputs=None,
        input_sh=None,
        suite: Callable[[Transformer, object], dict] | None = None,
    ):
        self.tokenizer = tokenizer
        self.mesh = mesh
        self.model_config = model_config
        self.max_batches = config.train.eval_batches
        self.lora, self.inputs = config.lora, dict(inputs or {})  # LoRA: {"base": ...}
        self.data_config = None
        if config.eval_data:
            self.data_config = dataclasses.replace(
                config.data, sources=config.eval_data, shuffle=False, num_epochs=1, curriculum=()
            )  # (the training curriculum names the training sources)

            def step(params, inputs, batch):
                policy = Policy(self.lora, inputs.get("base"))
                return sft_loss(model_config, 0.0, policy=policy)(params, batch, None)

            jitted = jax.jit(step, in_shardings=(shardings, dict(input_sh or {}), None))
            self._step = lambda params, batch: jitted(params, self.inputs, batch)
            # (fails at startup, not at the first eval)
            make_pipeline(self.data_config, tokenizer, vision=model_config.vision)
        self.suite = suite

    def __call__(self, state) -> dict:
        out = {}
        if self.data_config is not None:
            batches = make_pipeline(
                self.data_config, self.tokenizer, vision=self.model_config.vision
            )
            totals = summed(self._step, state.params, batches, self.mesh, self.max_batches)
            n = max(totals.get("num_tokens", 0.0), 1.0)
            out = {
                "eval_loss": totals.get("nll_sum", 0.0) / n,
                "eval_accuracy": totals.get("accuracy_sum", 0.0) / n,
                "eval_tokens": totals.get("num_tokens", 0.0),
            }
        if self.suite is not None:
            params = state.params
            if self.lora is not None:
                params = merge_jit(self.inputs["base"], params, lora=self.lora)
            metrics = self.suite(Transformer(params, self.model_config), self.tokenizer)
            out.update({f"suite/{name}": value for name, value in metrics.items()})
        return out


def run_sft(
    config: SFTConfig,
    workdir: str,
    *,
    on_metrics=None,
    suite: Callable[[Transformer, object], dict] | None = None,
) -> dict:
    """Trains (or resumes) an SFT run in `workdir`; returns the loop summary.

    `suite`: `(model, tokenizer) -> metrics`, the `eval_suite` run at every eval step (built by
    `posttrain.eval.suite_evaluator`, which the `sft` record's run passes). Everything that can
    be wrong with the config or data is reported before anything compiles.
    """
    if config.eval_suite and suite is None:
        raise ConfigError(
            f"eval_suite={config.eval_suite!r} needs its evaluator: run SFT through "
            "posttrain.methods.run_from_config (as `posttrain train` does), or pass "
            f"suite=posttrain.eval.suite_evaluator({config.eval_suite!r})"
        )
    mesh, tokenizer, model_config = setup(config, workdir)
    data = make_pipeline(config.data, tokenizer, vision=model_config.vision)
    manifest = data.manifest()
    paths.write_text(paths.join(workdir, "manifest.json"), json.dumps(manifest, indent=2))
    seed, lora = config.train.seed, config.lora
    extras = {
        "config": to_json(config),
        "model_config": to_json(model_config),
        "manifest": manifest,
    }
    inputs, input_sh = {}, {}
    with axis_rules(config.mesh.axis_rules), jax.set_mesh(mesh):
        plan = sft_plan(config, model_config, mesh)
        if lora is not None:
            inputs, input_sh = base_inputs(lora, config.model, model_config, mesh, seed)
            extras["lora"] = lora_json(lora, config.model, seed)
        evaluate = (
            _Evaluator(
                config,
                tokenizer,
                model_config,
                mesh,
                plan.trainable.shardings,
                inputs,
                input_sh,
                suite,
            )
            if config.eval_data or suite is not None
            else None
        )
    summary = train(
        config,
        workdir,
        mesh=mesh,
        plan=plan,
        data=data,
        loss_inputs=inputs,
        loss_input_shardings=input_sh,
        evaluate=evaluate,
        extras=extras,
        flops_per_token=model_config.flops_per_token(config.data.max_len),
        on_metrics=on_metrics,
    )
    summary["model_config"] = model_config
    if lora is not None:
        summary["base_params"] = inputs["base"]
    return summary


def sft_batch(c: SFTConfig, mesh):
    """One SFT step's global batch as abstract arrays (what `make_pipeline` yields: packed
    rows of `data.max_len` tokens), its tokens and its length."""
    rows, length = c.data.batch_size, c.data.max_len
    shapes = {k: ((rows, length), jnp.int32) for k in (*SEQUENCE, "domain_ids")}
    shapes["loss_mask"] = ((rows, length), jnp.float32)
    shapes |= images(c, rows, length, c.data.max_images)
    return abstract(shapes, mesh), rows * length, length


def _run(config: SFTConfig, workdir: str, **kwargs) -> dict:
    """SFT with its periodic eval suite, built here: eval sits beside train, not below it."""
    suite = suite_evaluator(config.eval_suite) if config.eval_suite else None
    return run_sft(config, workdir, suite=suite, **kwargs)


SFT = Method(
    name="sft",
    config=SFTConfig,
    run=_run,
    plan=lambda c, m, mesh, domains: sft_plan(c, m, mesh),
    frozen=policy_frozen,
    batch=sft_batch,
    rows=lambda c: c.data.batch_size,
)
