"""Reward models: the transformer trunk with one scalar head per domain, trained on preference
pairs with a Bradley-Terry loss; a saved run scores completions (`rm:<path>` reward terms) and is
what a PPO critic can start from.

The params are `{"trunk": the transformer without its LM head, "head": [D, H]}`; a sequence's
reward under head h is `hidden(last token) @ head[:, h]` (the last real token of the row, as
HF's `*ForSequenceClassification`). A pair of domain d is scored by head d only, so one trunk
serves several domains whose preferences may disagree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from posttrain import paths
from posttrain.config import ConfigError
from posttrain.lora import LoRAConfig, Policy
from posttrain.losses import bradley_terry_loss
from posttrain.models import ModelConfig, ModelSpec, param_shardings
from posttrain.parallel import axis_rules, named_sharding
from posttrain.rewards import reward_scores, reward_shapes
from posttrain.rewards import without_lm_head as _trunk
from posttrain.train._dpo import PreferenceRunConfig, _stacked, domain_accuracy_sums
from posttrain.train._lora import base_inputs, lora_json, lora_trainable
from posttrain.train._params import start_params, to_json
from posttrain.train._preference import PreferenceEvaluator, preference_data
from posttrain.train._run import StepPlan, Trainable, decay_mask, setup, train


def reward_model_loss(
    model_config: ModelConfig,
    *,
    center_coefficient: float = 0.0,
    use_margins: bool = True,
    domains: Sequence[str] = (),
    policy: Policy | None = None,
):
    """`(params, batch, rng) -> sums` of the Bradley-Terry loss, for `train_step`.

    Chosen and rejected rows run in one forward pass; pair i is scored by head
    `domain_ids[i]`. With `use_margins`, the batch's `margins` (records' `margin` field) shift
    the comparison: `-log sigmoid(r_c - r_r - margin)`. Sums: `loss_sum`, `num_tokens` (pairs),
    `accuracy_sum`, `rewards/chosen_sum`, `rewards/rejected_sum`, `rewards/margins_sum`, and
    `accuracy/<domain>_sum` / `_count` per domain.

    `params` are `{<policy.key>: the trunk's trained params, "head"}`; `policy` (default: a
    full trunk under "trunk") runs the trunk from them (LoRA: adapters on a frozen trunk, the
    head trained in full, like PEFT's `modules_to_save`).
    """
    policy = policy or Policy(key="trunk")

    def loss_fn(params, batch, rng):
        del rng
        x = _stacked(batch)
        heads_2B = jnp.concatenate([batch["domain_ids"], batch["domain_ids"]])
        trunk, kwargs = policy.apply(params)
        rewards_2B = reward_scores(
            {"trunk": trunk, "head": params["head"]},
            model_config,
            x["tokens"],
            x["positions"],
            x["segment_ids"],
            heads_2B,
            **kwargs,
        )
        chosen_B, rejected_B = jnp.split(rewards_2B, 2)
        lengths_c_B, lengths_r_B = jnp.split(jnp.sum(x["loss_mask"], axis=-1), 2)
        valid_B = (lengths_c_B > 0) & (lengths_r_B > 0)
        out = bradley_terry_loss(
            chosen_B,
            rejected_B,
            margin_B=batch["margins"] if use_margins else None,
            center_coefficient=center_coefficient,
        )
        total = lambda v: jnp.sum(jnp.where(valid_B, v, 0.0))
        return {
            **domain_accuracy_sums(out["accuracies"], valid_B, batch["domain_ids"], domains),
            "loss_sum": total(out["losses"]),
            "num_tokens": jnp.sum(valid_B.astype(jnp.float32)),
            "accuracy_sum": total(out["accuracies"]),
            "rewards/chosen_sum": total(out["rewards/chosen"]),
            "rewards/rejected_sum": total(out["rewards/rejected"]),
            "rewards/margins_sum": total(out["margins"]),
        }

    return loss_fn


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


def _head_init(model_config: ModelConfig, mesh, seed: int, heads: int):
    """(a function making the initial heads N(0, 1/(D+1)) `[D, heads]`, their sharding)."""
    D = model_config.embed_dim
    sharding = named_sharding(("embed", None), (D, heads), mesh)

    def init():
        head = jax.random.normal(jax.random.key(seed + 1), (D, heads), jnp.float32)
        return jax.device_put(head / np.sqrt(D + 1), sharding)

    return init, sharding


def lora_reward_trainable(lora: LoRAConfig, model_config: ModelConfig, mesh, seed: int, heads):
    """A LoRA reward model's trained params: the adapters and the heads."""
    adapters = lora_trainable(lora, model_config, mesh, seed)
    head, head_sharding = _head_init(model_config, mesh, seed, heads)
    return Trainable(
        shapes={"adapters": adapters.shapes, "head": reward_shapes(model_config, heads)["head"]},
        shardings={"adapters": adapters.shardings, "head": head_sharding},
        decay_mask={"adapters": adapters.decay_mask, "head": True},
        init=lambda: {"adapters": adapters.init(), "head": head()},
    )


def reward_trainable(spec: ModelSpec, model_config: ModelConfig, mesh, seed: int, heads: int):
    """The reward model's params: trunk from `spec` (random, HF or a run), heads N(0, 1/(D+1))."""
    head, head_sharding = _head_init(model_config, mesh, seed, heads)

    def init():
        return {"trunk": _trunk(start_params(spec, model_config, mesh, seed)), "head": head()}

    return Trainable(
        shapes=reward_shapes(model_config, heads),
        shardings={"trunk": _trunk(param_shardings(model_config, mesh)), "head": head_sharding},
        decay_mask={"trunk": _trunk(decay_mask(model_config)), "head": True},
        init=init,
    )


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
