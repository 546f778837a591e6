"""MoE router replay for RL (`loss.router_replay`): the trainer's passes route each token to the
experts the sampler routed it to, instead of recomputing the top-k.

The trainer's router logits differ from the sampler's by rounding (another batch shape, another
kernel, bfloat16), so a token's top-k flips now and then; each flip changes the token's output,
its log-prob and everything that attends to it, and MoE RL drifts or collapses on it. The
engine records every position's experts (`EngineConfig.record_routes`, prompt and completion),
`rollout_batch` lays them out as `routed_experts [rows, L, MoE layers, top-k]` (-1 where nothing
was sampled), and the passes hand them to the model (`hidden_states(replay_experts_BLTK=...)`):
"logprob" in the old-policy and reference passes, "update" in the update's loss pass too. The
gate weights stay the router's current scores at the replayed experts (the choice of Megatron's
RouterReplay, verl and slime's R2/R3), so the router still gets its gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

REPLAY_MODES = ("off", "logprob", "update")


def replay_kwargs(on: bool, batch: dict) -> dict:
    """The model's router-replay argument for a pass over `batch` (empty when `on` is False)."""
    return {"replay_experts_BLTK": batch["routed_experts"]} if on else {}


def router_mismatch(own_BLTK: jax.Array, sampled_BLTK: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Where the trainer's own routing differs from the sampler's.

    Args:
      own_BLTK: the trainer's top-k of every position and MoE layer (`aux["routed_experts"]`).
      sampled_BLTK: the sampler's (`batch["routed_experts"]`; -1 at positions it never ran).

    Returns:
      `(mismatch_BL, recorded_BL)`: the share of a position's MoE layers whose expert set
      differs (order within the top-k does not count), and 1.0 where the sampler recorded the
      position; their masked mean is the share of (token, layer) routing choices that differ.
    """
    own = jnp.sort(own_BLTK.astype(jnp.int32), axis=-1)
    sampled = jnp.sort(sampled_BLTK.astype(jnp.int32), axis=-1)
    differs_BLT = jnp.any(own != sampled, axis=-1)
    recorded_BL = (sampled_BLTK[..., 0, 0] >= 0).astype(jnp.float32)
    return jnp.mean(differs_BLT.astype(jnp.float32), axis=-1), recorded_BL


def route_shape(mode: str, model_config) -> tuple[int, int] | None:
    """`(MoE layers, top-k)` of the batch's `routed_experts` (None: replay off)."""
    if mode == "off":
        return None
    return model_config.num_moe_layers, model_config.moe.top_k


def check_router_replay(c, model_config) -> None:
    """A `ConfigError` for a run `loss.router_replay` cannot serve (`c` an `RLConfig`)."""
    from posttrain.config import ConfigError

    mode = c.loss.router_replay
    if mode == "off":
        return
    if model_config.moe is None:
        raise ConfigError(
            f"loss.router_replay={mode!r} replays MoE routing, but the model is dense; set "
            "loss.router_replay='off'"
        )
    if c.rollout.engine.speculative or c.env.name:
        raise ConfigError(
            f"loss.router_replay={mode!r} needs single-turn rollouts decoded without drafts (the "
            "engine records the routing); set rollout.engine.speculative=0 and env.name='', or "
            "router_replay='off'"
        )
