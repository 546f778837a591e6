"""A reward-model run: its config, its step (`reward_model_loss` on the trunk and one head per
domain, `posttrain.train`'s), frozen inputs, batch, driver and `Method` record; a saved run
scores completions (`rm:<path>` reward terms) and is what a PPO critic can start from."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax

from posttrain import paths
from posttrain.config import ConfigError
from posttrain.lora import Policy
from posttrain.methods._dpo import PreferenceRunConfig, preference_batch
from posttrain.methods._method import Method, lora_base
from posttrain.methods._preference import PreferenceEvaluator, preference_data
from posttrain.models import ModelConfig
from posttrain.parallel import axis_rules
from posttrain.rewards import without_lm_head as _trunk
from posttrain.train import (
    StepPlan,
    base_inputs,
    lora_json,
    lora_reward_trainable,
    reward_model_loss,
    reward_trainable,
    setup,
    to_json,
    train,
)


@dataclasses.dataclass(frozen=True)
class RewardLossConfig:
    center_coefficient: float = 0.0  # weight of (r_c + r_r)^2, keeping rewards centred on 0
    use_margins: bool = True  # subtract the records' "margin" (graded preferences)

    def __post_init__(self):
        if not self.center_coefficient >= 0:
            raise ConfigError(
                f"loss.center_coefficient must be >= 0, got {self.center_coefficient}"
            )


@dataclasses.dataclass(frozen=True)
class RewardModelConfig(PreferenceRunConfig):
    """A reward-model run: the trunk starts from `model`; each data domain gets a head."""

    loss: RewardLossConfig = RewardLossConfig()


def rm_plan(
    config: RewardModelConfig, model_config: ModelConfig, mesh, heads: Sequence[str]
) -> StepPlan:
    """A reward model's step: the trunk and one head per domain in `heads` (or LoRA adapters
    and the heads; the loss's one input is then the frozen base's trunk) under the
    Bradley-Terry loss with every option of `config.loss`."""
    lora, seed = config.lora, config.train.seed
    if lora is None:
        trainable = reward_trainable(config.model, model_config, mesh, seed, len(heads))
    else:
        trainable = lora_reward_trainable(lora, model_config, mesh, seed, len(heads))

    def loss(frozen: dict):  # {"base": LoRA's frozen base trunk} or {}
        base = frozen.get("base")
        return reward_model_loss(
            model_config,
            center_coefficient=config.loss.center_coefficient,
            use_margins=config.loss.use_margins,
            domains=heads,
            policy=Policy(lora, base, key="adapters" if lora else "trunk"),
        )

    return StepPlan(trainable, loss)


def run_reward_model(config: RewardModelConfig, workdir: str, *, on_metrics=None) -> dict:
    """Trains (or resumes) a multi-domain reward model in `workdir`; returns the loop summary.

    The heads are the training data's domains (a record's `domain`, else its source's), in
    `data.domains` order; they are saved with every checkpoint, so `load_reward_model` (and
    `rm:<workdir>` reward terms) know which head scores which domain.
    """
    mesh, tokenizer, model_config = setup(config, workdir)
    data, eval_data, manifest = preference_data(config, tokenizer, workdir)
    heads, lora, seed = data.domains, config.lora, config.train.seed

    extras = {
        "config": to_json(config),
        "model_config": to_json(model_config),
        "manifest": manifest,
        "heads": list(heads),
        "tokenizer": str(paths.path(config.tokenizer or config.model.hf_path)),
    }
    inputs, input_sh = {}, {}
    with axis_rules(config.mesh.axis_rules), jax.set_mesh(mesh):
        plan = rm_plan(config, model_config, mesh, heads)
        loss, trainable = plan.loss, plan.trainable
        if lora is not None:
            base, base_sh = base_inputs(lora, config.model, model_config, mesh, seed)
            inputs, input_sh = {"base": _trunk(base["base"])}, {"base": _trunk(base_sh["base"])}
            del base  # (its lm_head is not needed)
            extras["lora"] = lora_json(lora, config.model, seed, ("adapters",))
        evaluate = None
        if eval_data is not None:
            evaluate = PreferenceEvaluator(
                eval_data,
                loss,
                mesh,
                trainable.shardings,
                config.train.eval_batches,
                heads,
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
        flops_per_token=model_config.flops_per_token(config.data.max_len, lm_head=False),
        on_metrics=on_metrics,
    )
    summary["model_config"] = model_config
    summary["heads"] = summary["domains"] = heads
    return summary


def rm_frozen(c: RewardModelConfig, model_config: ModelConfig, mesh) -> dict:
    """A LoRA reward model's frozen base trunk, or nothing."""
    return {"base": _trunk(lora_base(c, model_config, mesh))} if c.lora is not None else {}


RM = Method(
    name="rm",
    config=RewardModelConfig,
    run=run_reward_model,
    plan=rm_plan,
    frozen=rm_frozen,
    batch=preference_batch,
    rows=lambda c: c.data.batch_size,
    lm_head=False,
)
