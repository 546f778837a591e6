"""Reinforcement learning's machinery: the RL config, rollout sources (single- and multi-turn,
whole or partial, co-located or on their own devices), the scorer (old-policy, reference,
critic and teacher log-probs), advantages and the policy loss wiring, the critic, the
distillation teacher, staleness and the domain sampler. The RL methods (GRPO, PPO,
distillation: `posttrain.methods`) compose them into a run on the shared train loop."""

from posttrain.rl._config import (
    AlgorithmConfig,
    DistillConfig,
    KLConfig,
    OfflineConfig,
    RewardsConfig,
    RLConfig,
    RolloutConfig,
)
from posttrain.rl._critic import critic_config, value_trainable
from posttrain.rl._episodes_rollout import make_episode_env
from posttrain.rl._loss import CriticLoss, PolicyLossConfig, rl_loss, sequence_log_probs
from posttrain.rl._partial import PartialProducer
from posttrain.rl._prompts import AdaptiveDomains, PromptData
from posttrain.rl._replay import check_router_replay, route_shape
from posttrain.rl._rollout import Rollouts, sample_groups, score_groups
from posttrain.rl._rollout_batch import rollout_batch, split_rows
from posttrain.rl._rollout_producer import RolloutProducer
from posttrain.rl._sampler_weights import SamplerWeights
from posttrain.rl._scorer import Scorer
from posttrain.rl._shares import gather_groups, prompt_share
from posttrain.rl._source import RolloutSource
from posttrain.rl._teacher import Teacher, split_teacher_devices, teacher_model

__all__ = [
    "AdaptiveDomains",
    "AlgorithmConfig",
    "CriticLoss",
    "DistillConfig",
    "KLConfig",
    "OfflineConfig",
    "PartialProducer",
    "PolicyLossConfig",
    "PromptData",
    "RLConfig",
    "RewardsConfig",
    "RolloutConfig",
    "RolloutProducer",
    "RolloutSource",
    "Rollouts",
    "SamplerWeights",
    "Scorer",
    "Teacher",
    "check_router_replay",
    "make_episode_env",
    "rl_loss",
    "rollout_batch",
    "route_shape",
    "sample_groups",
    "gather_groups",
    "prompt_share",
    "score_groups",
    "sequence_log_probs",
    "split_rows",
    "split_teacher_devices",
    "teacher_model",
    "critic_config",
    "value_trainable",
]
