"""Next-token cross-entropy, returned as sums so callers normalise by the global token count."""

from __future__ import annotations

import jax

from posttrain.losses._chunked import cross_entropy_from_stats, logit_stats


def token_log_probs(logits_BLV: jax.Array, targets_BL: jax.Array) -> jax.Array:
    """log p(target) at every position, float32 `[B, L]`."""
    return logit_stats(logits_BLV, targets_BL)["logp"]


def cross_entropy_sums(
    logits_BLV: jax.Array, targets_BL: jax.Array, mask_BL: jax.Array, z_loss: float = 0.0
) -> dict[str, jax.Array]:
    """Summed next-token loss over the masked positions.

    Args:
      logits_BLV: model logits.
      targets_BL: the token each position should predict.
      mask_BL: 1 where the target is trained on, 0 elsewhere (prompt, padding, document ends).
      z_loss: weight of `log(Z)^2`, which keeps the softmax normaliser near 1 (PaLM).

    Returns:
      `loss_sum` (cross-entropy + z-loss), `nll_sum`, `z_loss_sum`, `accuracy_sum` (argmax
      hits) and `num_tokens`: sums, so micro-batches and shards add up exactly and the caller
      divides once by the global `num_tokens` (a token mean, not a mean of means).
    """
    return cross_entropy_from_stats(logit_stats(logits_BLV, targets_BL), mask_BL, z_loss)
