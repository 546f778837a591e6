"""A DPO-family run: its config, its step (`dpo_loss` under every option of the config), frozen
inputs, batch, driver and `Method` record. The loss and the reference log-probs are
`posttrain.train`'s (`dpo_loss`, `reference_logps`; eval scores pairs with them too)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from posttrain import paths
from posttrain.config import ConfigError
from posttrain.data import DataConfig, SourceConfig
from posttrain.lora import LoRAConfig, Policy
from posttrain.losses import LOSS_TYPES, REFERENCE_FREE
from posttrain.methods._method import SEQUENCE, Method, abstract, images, lora_base
from posttrain.methods._preference import PreferenceEvaluator, attach_reference, preference_data
from posttrain.models import (
    ModelConfig,
    ModelSpec,
    checkpoint_json,
    param_shapes,
    param_shardings,
    with_shardings,
)
from posttrain.parallel import MeshConfig, axis_rules
from posttrain.train import (
    REFERENCES,
    CheckpointConfig,
    LoopConfig,
    OptimizerConfig,
    StepPlan,
    base_inputs,
    dpo_loss,
    lora_json,
    policy_trainable,
    reference_logps,
    setup,
    to_json,
    train,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PreferenceLossConfig:
    """Which pairwise loss, and where its reference log-probs come from."""

    # sigmoid (DPO) | ipo | hinge | robust | sppo_hard | nca_pair | simpo | orpo
    type: str = "sigmoid"
    beta: float = 0.1  # inverse temperature of the implicit reward
    label_smoothing: float = 0.0  # cDPO / robust label noise
    gamma: float = 0.0  # SimPO target reward margin
    sft_weight: float = 0.0  # weight of the chosen responses' NLL (RPO); orpo has its own
    # auto: "precomputed" for reference-based losses, "none" for simpo/orpo; or "on_the_fly"
    reference: str = "auto"

    def __post_init__(self):
        if self.type not in LOSS_TYPES:
            raise ConfigError(f"loss.type={self.type!r}: use one of {', '.join(LOSS_TYPES)}")
        if self.reference not in ("auto", *REFERENCES):
            raise ConfigError(
                f"loss.reference={self.reference!r}: use auto, {', '.join(REFERENCES)}"
            )
        free = self.type in REFERENCE_FREE
        if self.reference != "auto" and (self.reference == "none") != free:
            want = "none (or auto)" if free else "precomputed, on_the_fly (or auto)"
            raise ConfigError(f"loss.type={self.type!r} needs loss.reference={want}")
        if self.beta <= 0:
            raise ConfigError(f"loss.beta must be positive, got {self.beta}")

    @property
    def resolved_reference(self) -> str:
        if self.reference != "auto":
            return self.reference
        return "none" if self.type in REFERENCE_FREE else "precomputed"


@dataclasses.dataclass(frozen=True)
class PreferenceRunConfig:
    """What DPO and reward-model runs share (each adds its own `loss`)."""

    model: ModelSpec = ModelSpec()  # where training starts (usually an SFT run's checkpoint)
    tokenizer: str = ""  # tokenizer directory; default: model.hf_path
    data: DataConfig = None  # preference sources; packing must be False (one pair per row)
    eval_data: tuple[SourceConfig, ...] = ()  # held-out preference sources
    optimizer: OptimizerConfig = OptimizerConfig()
    train: LoopConfig = LoopConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    mesh: MeshConfig = MeshConfig()
    # LoRA adapters on the frozen `model` (docs/lora.md); None: the full model is trained.
    lora: LoRAConfig | None = None

    def __post_init__(self):
        if self.data is None:
            raise ConfigError("data: set data.sources to at least one preference file")
        if self.data.packing:
            raise ConfigError("data.packing: preference pairs take one row each; set it False")
        if self.data.curriculum:
            raise ConfigError("data.curriculum: SFT runs only so far; set data.curriculum=[]")


@dataclasses.dataclass(frozen=True)
class DPOConfig(PreferenceRunConfig):
    """A DPO-family run; the reference is a frozen copy of the policy's start (`model`)."""

    loss: PreferenceLossConfig = PreferenceLossConfig()


def dpo_plan(
    config: DPOConfig, model_config: ModelConfig, mesh, domains: Sequence[str] = ()
) -> StepPlan:
    """A DPO-family step: the policy (or LoRA adapters) under `config.loss`, every option of
    it. The loss's named inputs: {"reference": the on-the-fly reference}, or with LoRA
    {"base": the frozen base}, whose adapters-off pass is the reference; else {} (precomputed,
    or reference-free)."""
    lc, lora = config.loss, config.lora
    reference = lc.resolved_reference

    def loss(frozen: dict):  # {"base": LoRA's frozen base} or {"reference": ...} or {}
        return dpo_loss(
            model_config,
            loss_type=lc.type,
            beta=lc.beta,
            label_smoothing=lc.label_smoothing,
            gamma=lc.gamma,
            reference=reference,
            ref_params=frozen.get("reference"),
            sft_weight=lc.sft_weight,
            domains=domains,
            policy=Policy(lora, frozen.get("base")),
        )

    return StepPlan(policy_trainable(config, model_config, mesh), loss)


def run_dpo(config: DPOConfig, workdir: str, *, on_metrics=None) -> dict:
    """Trains (or resumes) a DPO-family run in `workdir`; returns the loop summary.

    The reference is the policy's starting weights (`config.model`), reloaded on resume. Its
    log-probs are computed once per dataset and stored under `workdir/reference/`
    ("precomputed", the default: no second model in memory while training), or computed in
    every step ("on_the_fly"), or not needed (simpo, orpo). With `config.lora` the policy is
    the frozen base plus trained adapters, and the reference is that base with the adapters
    off (one copy of the weights, quantised with QLoRA).
    """
    mesh, tokenizer, model_config = setup(config, workdir)
    data, eval_data, manifest = preference_data(config, tokenizer, workdir, model_config.vision)
    lora, seed = config.lora, config.train.seed
    reference = config.loss.resolved_reference
    on_the_fly = reference == "on_the_fly"

    extras = {
        "config": to_json(config),
        "model_config": to_json(model_config),
        "manifest": manifest,
        "domains": list(data.domains),
    }
    inputs, input_sh = {}, {}
    with axis_rules(config.mesh.axis_rules), jax.set_mesh(mesh):
        plan = dpo_plan(config, model_config, mesh, data.domains)
        loss, trainable = plan.loss, plan.trainable
        if lora is None:
            reference_weights = functools.cache(trainable.init)  # loaded only if needed
            if on_the_fly:
                inputs = {"reference": reference_weights()}
                input_sh = {"reference": trainable.shardings}
        else:  # the reference is the frozen base with the adapters off: no second copy
            inputs, input_sh = base_inputs(lora, config.model, model_config, mesh, seed)
            reference_weights = lambda: inputs["base"]  # noqa: E731
            extras["lora"] = lora_json(lora, config.model, seed)
        if reference == "precomputed":
            identity = {"model": to_json(config.model), "seed": seed}
            if lora is not None and lora.quantize:  # the reference is the quantised base
                identity["quantize"] = [lora.quantize, lora.quant_block]
            if config.model.checkpoint:  # that run may have saved newer params since
                identity["step"] = checkpoint_json(config.model.checkpoint)["step"]
            process = f"process_{jax.process_index()}"

            def score(params, batch):  # (params: the reference, or LoRA's frozen base)
                ref_model, kwargs = Policy(lora, params if lora else None).reference(params)
                return reference_logps(ref_model, model_config, batch, **kwargs)

            score = jax.jit(score)
            for name, d in (("train", data), ("eval", eval_data)):
                if d is not None:
                    path = paths.join(workdir, "reference", f"{name}.{process}.npz")
                    attach_reference(d, reference_weights, score, mesh, path, identity)
            if lora is None:
                reference_weights.cache_clear()  # the weights are no longer needed
        evaluate = None
        if eval_data is not None:
            evaluate = PreferenceEvaluator(
                eval_data,
                loss,
                mesh,
                trainable.shardings,
                config.train.eval_batches,
                data.domains,
                inputs,
                input_sh,
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
        # An on-the-fly reference adds one forward pass (a third of a training step's FLOPs).
        flops_per_token=model_config.flops_per_token(config.data.max_len)
        * (4 / 3 if on_the_fly else 1),
        on_metrics=on_metrics,
    )
    summary.update(model_config=model_config, domains=data.domains)
    if eval_data is not None:
        summary["eval_data"] = dict(eval_data.stats)
    return summary


def dpo_frozen(c: DPOConfig, model_config: ModelConfig, mesh) -> dict:
    """The LoRA base (whose adapters-off pass is the reference), else the on-the-fly reference
    (a second copy of the policy's weights), else nothing."""
    if c.lora is not None:
        return {"base": lora_base(c, model_config, mesh)}
    if c.loss.resolved_reference == "on_the_fly":
        full = with_shardings(param_shapes(model_config), param_shardings(model_config, mesh))
        return {"reference": full}
    return {}


def preference_batch(c, mesh, references: bool = False, vision: bool = False):
    """One step's pairs as abstract arrays (what `make_preference_pipeline` yields;
    `references`: with their precomputed reference log-probs; `vision`: a VLM's pair images,
    DPO), their tokens and length."""
    rows, length = c.data.batch_size, c.data.max_len
    shapes = {}
    for side in ("chosen", "rejected"):
        shapes |= {f"{side}_{k}": ((rows, length), jnp.int32) for k in SEQUENCE}
        shapes[f"{side}_loss_mask"] = ((rows, length), jnp.float32)
    shapes |= {"domain_ids": ((rows,), jnp.int32), "margins": ((rows,), jnp.float32)}
    shapes |= images(c, rows, length, c.data.max_images) if vision else {}
    if references:
        shapes |= {k: ((rows,), jnp.float32) for k in ("ref_chosen_logps", "ref_rejected_logps")}
    return abstract(shapes, mesh), 2 * rows * length, length


def dpo_batch(c: DPOConfig, mesh):
    return preference_batch(c, mesh, c.loss.resolved_reference == "precomputed", vision=True)


DPO = Method(
    name="dpo",
    config=DPOConfig,
    run=run_dpo,
    plan=dpo_plan,
    frozen=dpo_frozen,
    batch=dpo_batch,
    rows=lambda c: c.data.batch_size,
)
