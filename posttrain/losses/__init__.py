"""Pure loss functions over logits / log-probs and masks."""

from posttrain.losses._preference import LOSS_TYPES, preference_loss, sequence_logps
from posttrain.losses._sft import cross_entropy_sums, token_log_probs

__all__ = [
    "LOSS_TYPES",
    "cross_entropy_sums",
    "preference_loss",
    "sequence_logps",
    "token_log_probs",
]
