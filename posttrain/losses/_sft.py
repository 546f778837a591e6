"""Next-token cross-entropy, returned as sums so callers normalise by the global token count."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_log_probs(logits_BLV: jax.Array, targets_BL: jax.Array) -> jax.Array:
    """log p(target) at every position, float32 `[B, L]`."""
    logits = logits_BLV.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logits = jnp.take_along_axis(logits, targets_BL[..., None], axis=-1)[..., 0]
    return target_logits - log_z


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
    logits = logits_BLV.astype(jnp.float32)
    mask = mask_BL.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logits = jnp.take_along_axis(logits, targets_BL[..., None], axis=-1)[..., 0]
    nll_sum = jnp.sum((log_z - target_logits) * mask)
    z_sum = jnp.sum(jnp.square(log_z) * mask)
    correct = jnp.sum((jnp.argmax(logits, axis=-1) == targets_BL) * mask)
    return {
        "loss_sum": nll_sum + z_loss * z_sum,
        "nll_sum": nll_sum,
        "z_loss_sum": z_sum,
        "accuracy_sum": correct,
        "num_tokens": jnp.sum(mask),
    }
