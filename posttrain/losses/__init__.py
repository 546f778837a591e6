"""Pure loss functions over logits / log-probs and masks."""

from posttrain.losses._sft import cross_entropy_sums, token_log_probs

__all__ = ["cross_entropy_sums", "token_log_probs"]
