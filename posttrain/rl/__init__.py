"""Reinforcement learning with verifiable rewards: the GRPO family (GRPO, Dr.GRPO, DAPO, GSPO,
RLOO) and PPO on the shared train loop: `RolloutSource` makes each step's batch from rollouts
(`posttrain.sampling`) and rewards (`posttrain.rewards`), `run_rl` runs it with `train`."""

from posttrain.rl._config import (
    AlgorithmConfig,
    DistillConfig,
    KLConfig,
    RewardsConfig,
    RLConfig,
    RolloutConfig,
)
from posttrain.rl._loss import PolicyLossConfig, rl_loss, sequence_log_probs
from posttrain.rl._prompts import PromptData
from posttrain.rl._replay import route_shape
from posttrain.rl._rollout import rollout_batch, split_rows
from posttrain.rl._source import RolloutSource
from posttrain.rl._trainer import rl_plan, run_rl, split_devices

__all__ = [
    "AlgorithmConfig",
    "DistillConfig",
    "KLConfig",
    "PolicyLossConfig",
    "PromptData",
    "RLConfig",
    "RewardsConfig",
    "RolloutSource",
    "RolloutConfig",
    "rl_loss",
    "rollout_batch",
    "run_rl",
    "sequence_log_probs",
    "split_rows",
    "rl_plan",
    "route_shape",
    "split_devices",
]
