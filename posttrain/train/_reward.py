"""Reward models: the transformer trunk with one scalar head per domain, trained on preference
pairs with a Bradley-Terry loss; a saved run scores completions (`rm:<path>` reward terms) and is
what a PPO critic can start from.

The params are `{"trunk": the transformer without its LM head, "head": [D, H]}`; a sequence's
reward under head h is `hidden(last token) @ head[:, h]` (the last real token of the row, as
HF's `*ForSequenceClassification`). A pair of domain d is scored by head d only, so one trunk
serves several domains whose preferences may disagree.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.lora import LoRAConfig, Policy
from posttrain.losses import bradley_terry_loss
from posttrain.models import ModelConfig, ModelSpec, param_shardings
from posttrain.parallel import named_sharding
from posttrain.rewards import reward_scores, reward_shapes
from posttrain.rewards import without_lm_head as _trunk
from posttrain.train._lora import lora_trainable
from posttrain.train._losses import domain_accuracy_sums, stacked_pairs
from posttrain.train._params import start_params
from posttrain.train._run import Trainable, decay_mask


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
        x = stacked_pairs(batch)
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
