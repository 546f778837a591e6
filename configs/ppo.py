"""PPO with a critic: GAE over response tokens, clipped value loss, KL as a reward penalty.

    make demo                                                    # writes runs/demo/sft
    posttrain train --config=configs/ppo.py:tiny --workdir=runs/ppo_tiny      # CPU

Presets:
  tiny          PPO on the demo's arithmetic problems from the demo's SFT model, the critic
                started from the policy (or set critic.init=rm:<reward model run>).
  qwen3_8b_v5p  PPO for Qwen3 8B on a v5p-64 slice (set model.hf_path / checkpoint, data).
Every field of configs/grpo.py applies; PPO is `algorithm.advantage=gae` plus `critic`.
"""

import os

import ml_collections

from posttrain.config import load_config_file

_HERE = os.path.dirname(os.path.abspath(__file__))


def get_config(preset: str = "tiny") -> ml_collections.ConfigDict:
    if preset not in ("tiny", "qwen3_8b_v5p"):
        raise ValueError(f"unknown ppo preset {preset!r}: tiny, qwen3_8b_v5p")
    c = load_config_file(os.path.join(_HERE, "grpo.py") + ":" + preset)
    c.method = "ppo"
    c.algorithm.advantage = "gae"  # per-token advantages from the critic
    c.algorithm.gamma = 1.0  # discount over response tokens
    c.algorithm.lam = 0.95  # GAE lambda
    c.algorithm.whiten_advantages = True
    c.algorithm.epochs = 2  # PPO epochs over each rollout batch
    c.algorithm.minibatches = 2
    c.rollout.num_generations = 4  # PPO needs no groups; a few samples per prompt still help
    c.data.batch_size *= 2
    if preset == "qwen3_8b_v5p":
        # The critic trains beside the policy: with the matmul outputs kept (the GRPO plan's
        # dots_no_batch) this step needs 112 of 95 GiB per chip on v5p-64, so full remat.
        c.model.remat = "full"

    c.critic = ml_collections.ConfigDict()
    c.critic.init = "policy"  # policy | rm:<reward model run>[#head]
    c.critic.coef = 0.5  # value-loss weight
    c.critic.clip = 0.2  # value clip (0: off)

    c.kl.mode = "reward"  # per-token KL penalty in the reward (InstructGPT)
    c.kl.coef = 0.02
    c.loss.kl_estimator = "k1"  # the log-ratio, as a per-token reward penalty
    return c
