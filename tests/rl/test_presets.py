"""The real-size RL presets trace at their real shapes (no weights allocated)."""

import functools
import os

import jax
import jax.numpy as jnp
import pytest

from posttrain.config import build, load_config_file
from posttrain.models import num_params, param_shapes
from posttrain.rewards import reward_shapes
from posttrain.rl import RLConfig, rl_loss
from posttrain.rl._loss import CriticLoss
from posttrain.train import create_state, make_optimizer, train_step

from .toy import REPO


@pytest.mark.parametrize(  # ppo (~50 s) in `make test-slow`: the critic's plan, tests/test_aot.py
    "file", ["grpo.py", pytest.param("ppo.py", marks=pytest.mark.slow)]
)
def test_qwen3_8b_preset_shape_check(file):
    values = load_config_file(os.path.join(REPO, "configs", file) + ":qwen3_8b_v5p")
    config = build(RLConfig, {k: v for k, v in values.items() if k != "method"})
    model_config = config.model.model_config()
    # (PPO's critic trains beside the policy: only full remat fits its slice, `--remat-sweep`)
    remat = "full" if config.ppo else "dots_no_batch"
    assert num_params(model_config) > 7e9 and model_config.remat == remat
    shapes = param_shapes(model_config)
    critic = None
    if config.ppo:
        shapes = {"policy": shapes, "value": reward_shapes(model_config, 1)}
        critic = CriticLoss(model_config)
    optimizer = make_optimizer(config.optimizer, config.updates)
    state = jax.eval_shape(functools.partial(create_state, optimizer=optimizer, seed=0), shapes)
    rows = config.rows // config.algorithm.minibatches
    length = config.rollout.max_prompt_len + config.rollout.max_new_tokens
    ints = ("tokens", "targets", "positions", "segment_ids")
    floats = ("loss_mask", "sampler_logps", "old_logps", "ref_logps", "returns", "old_values")
    batch = {k: jax.ShapeDtypeStruct((rows, length), jnp.int32) for k in ints}
    batch |= {k: jax.ShapeDtypeStruct((rows, length), jnp.float32) for k in floats}
    per_row = ("rewards", "truncated", "kl_coefs", "lengths")
    batch |= {k: jax.ShapeDtypeStruct((rows,), jnp.float32) for k in per_row}
    batch["domain_ids"] = jax.ShapeDtypeStruct((rows,), jnp.int32)
    advantages = (rows, length) if config.ppo else (rows,)
    batch["advantages"] = jax.ShapeDtypeStruct(advantages, jnp.float32)
    loss = rl_loss(
        model_config,
        config.loss,
        max_new_tokens=config.rollout.max_new_tokens,
        use_reference=config.kl.enabled,
        kl_in_loss=config.kl.mode == "loss",
        domains=("math",),
        critic=critic,
    )
    step = functools.partial(
        train_step, loss_fn=loss, optimizer=optimizer, micro_batches=config.train.micro_batches
    )
    new_state, metrics = jax.eval_shape(step, state, batch)
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    assert metrics["loss"].shape == () and ("value_loss" in metrics) == config.ppo
