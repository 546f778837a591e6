"""Pure loss functions over logits / log-probs and masks, and the per-token statistics of the
vocabulary distribution computed in chunks from hidden states (`token_stats`)."""

from posttrain.losses._chunked import cross_entropy_from_stats, logit_stats, token_stats
from posttrain.losses._correction import CORRECTION_LEVELS, CORRECTION_MODES, rollout_correction
from posttrain.losses._distill import distill_advantages
from posttrain.losses._offline import awr_loss, truncated_is_loss
from posttrain.losses._preference import (
    LENGTH_NORMALISED,
    LOSS_TYPES,
    REFERENCE_FREE,
    preference_loss,
    sequence_logps,
)
from posttrain.losses._reward import bradley_terry_loss
from posttrain.losses._rl import (
    ADVANTAGE_MODES,
    AGGREGATIONS,
    KL_KINDS,
    RATIO_LEVELS,
    adaptive_kl_update,
    aggregate,
    entropy_from_logits,
    gae,
    group_advantages,
    kl_estimate,
    policy_loss,
    value_loss,
    whiten,
)
from posttrain.losses._sft import cross_entropy_sums, token_log_probs

__all__ = [
    "ADVANTAGE_MODES",
    "AGGREGATIONS",
    "CORRECTION_LEVELS",
    "CORRECTION_MODES",
    "KL_KINDS",
    "LENGTH_NORMALISED",
    "LOSS_TYPES",
    "RATIO_LEVELS",
    "REFERENCE_FREE",
    "adaptive_kl_update",
    "aggregate",
    "awr_loss",
    "bradley_terry_loss",
    "cross_entropy_from_stats",
    "cross_entropy_sums",
    "distill_advantages",
    "entropy_from_logits",
    "gae",
    "group_advantages",
    "kl_estimate",
    "logit_stats",
    "policy_loss",
    "preference_loss",
    "rollout_correction",
    "sequence_logps",
    "token_log_probs",
    "token_stats",
    "truncated_is_loss",
    "value_loss",
    "whiten",
]
