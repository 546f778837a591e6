"""Pure loss functions over logits / log-probs and masks."""

from posttrain.losses._preference import (
    LENGTH_NORMALISED,
    LOSS_TYPES,
    REFERENCE_FREE,
    preference_loss,
    sequence_logps,
)
from posttrain.losses._reward import bradley_terry_loss
from posttrain.losses._sft import cross_entropy_sums, token_log_probs

__all__ = [
    "LENGTH_NORMALISED",
    "LOSS_TYPES",
    "REFERENCE_FREE",
    "bradley_terry_loss",
    "cross_entropy_sums",
    "preference_loss",
    "sequence_logps",
    "token_log_probs",
]
