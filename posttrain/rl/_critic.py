"""PPO's critic: a value model (a transformer trunk with one scalar head) scoring every token.

`V(prefix up to t)` is the trunk's hidden state at position t through the head, the same shape
as a reward model with one head. It starts from the policy's starting weights with a zero
head (values start at 0), or from a trained reward model (`rm:<path>[#head]`: its trunk and
that head), whose scores are a better first guess of the returns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posttrain.config import ConfigError
from posttrain.models import ModelConfig, ModelSpec, checkpoint_json, hidden_states, restore_params
from posttrain.models import with_shardings as _with_shardings
from posttrain.rewards import reward_params, reward_shapes
from posttrain.train import Trainable, reward_trainable


def token_values(params: dict, model_config: ModelConfig, batch: dict) -> jax.Array:
    """`[B, L]` float32 values: V at every position (read where the loss mask is on)."""
    hidden = hidden_states(
        params["trunk"],
        batch["tokens"],
        model_config,
        batch["positions"],
        batch["segment_ids"],
        images_BIHWC=batch.get("images"),
    )
    return jnp.einsum("bld,d->bl", hidden.astype(jnp.float32), params["head"][:, 0])


def critic_config(init: str, policy_config: ModelConfig) -> ModelConfig:
    """The config of the critic `critic.init` names: the policy's, or its reward model's
    (`value_trainable` checks the rest)."""
    if not init.startswith("rm:"):
        return policy_config
    from posttrain.config import build

    return build(ModelConfig, checkpoint_json(init[3:].partition("#")[0])["model_config"])


def value_trainable(
    init: str, spec: ModelSpec, policy_config: ModelConfig, mesh, seed: int
) -> tuple[Trainable, ModelConfig]:
    """The critic's params and config.

    Args:
      init: "policy" (the policy's starting trunk, a zero head) or "rm:<path>[#head]" (a reward
        model run: its trunk and that head; the only head if it has one).
      spec, policy_config: the policy's start (for "policy").
      mesh: the device mesh.
      seed: unused by "policy" (the head starts at zero), kept for a random-head variant.

    Raises:
      ConfigError: an unknown init, or a reward model without the named head.
    """
    if init == "policy":
        trainable = reward_trainable(spec, policy_config, mesh, seed, 1)
        inner = trainable.init

        def zero_head():
            params = inner()
            return {**params, "head": jnp.zeros_like(params["head"])}

        return Trainable(trainable.shapes, trainable.shardings, trainable.decay_mask, zero_head), (
            policy_config
        )
    if not init.startswith("rm:"):
        raise ConfigError(f"critic.init={init!r}: use 'policy' or 'rm:<reward model run>[#head]'")
    path, _, head = init[3:].partition("#")
    saved = checkpoint_json(path)
    heads = list(saved.get("heads") or [])
    if not heads:
        raise ConfigError(f"critic.init: {path} is not a reward-model run (no heads saved)")
    if not head and len(heads) > 1:
        raise ConfigError(f"critic.init: {path} has heads {heads}; pick one with rm:{path}#<head>")
    head = head or heads[0]
    if head not in heads:
        raise ConfigError(f"critic.init: {path} has no head {head!r}; its heads: {heads}")
    from posttrain.config import build

    config = build(ModelConfig, saved["model_config"])
    rm_spec = ModelSpec(checkpoint=path)
    trainable = reward_trainable(rm_spec, config, mesh, seed, 1)
    column = heads.index(head)

    def from_reward_model():
        if "lora" in saved:  # adapters merged into the trunk on one device, then sharded
            params = reward_params(path, saved)
            return jax.device_put(
                {"trunk": params["trunk"], "head": params["head"][:, column : column + 1]},
                trainable.shardings,
            )
        shapes = reward_shapes(config, len(heads))
        shardings = {
            "trunk": trainable.shardings["trunk"],
            "head": jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
        }
        params = restore_params(path, _with_shardings(shapes, shardings), saved["step"])
        head_D1 = params["head"][:, column : column + 1]
        return {
            "trunk": params["trunk"],
            "head": jax.device_put(head_D1, trainable.shardings["head"]),
        }

    return Trainable(
        trainable.shapes, trainable.shardings, trainable.decay_mask, from_reward_model
    ), config
