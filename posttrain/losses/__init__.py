"""Pure loss functions over logits / log-probs and masks."""

from posttrain.losses._preference import (
    LENGTH_NORMALISED,
    LOSS_TYPES,
    REFERENCE_FREE,
    preference_loss,
    sequence_logps,
)
from posttrain.losses._sft import cross_entropy_sums, token_log_probs

__all__ = [
    "LENGTH_NORMALISED",
    "LOSS_TYPES",
    "REFERENCE_FREE",
    "cross_entropy_sums",
    "preference_loss",
    "sequence_logps",
    "token_log_probs",
]
