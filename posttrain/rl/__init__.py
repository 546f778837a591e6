"""Reinforcement learning with verifiable rewards: the GRPO family (GRPO, Dr.GRPO, DAPO, GSPO,
RLOO) on the shared train step, with rollouts from `posttrain.sampling` and rewards from
`posttrain.rewards`."""

from posttrain.rl._config import (
    AlgorithmConfig,
    KLConfig,
    RewardsConfig,
    RLConfig,
    RolloutConfig,
)
from posttrain.rl._loss import PolicyLossConfig, rl_loss, sequence_log_probs
from posttrain.rl._prompts import PromptData
from posttrain.rl._rollout import rollout_batch, split_rows
from posttrain.rl._trainer import run_rl

__all__ = [
    "AlgorithmConfig",
    "KLConfig",
    "PolicyLossConfig",
    "PromptData",
    "RLConfig",
    "RewardsConfig",
    "RolloutConfig",
    "rl_loss",
    "rollout_batch",
    "run_rl",
    "sequence_log_probs",
    "split_rows",
]
