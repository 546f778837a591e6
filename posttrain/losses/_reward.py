"""Bradley-Terry pairwise loss for training a scalar reward model on preference pairs.

The definition follows TRL's `RewardTrainer.compute_loss`: `-log sig(r_c - r_r - margin)`, plus
`center_rewards_coefficient * mean((r_c + r_r)^2)` (Eisenstein et al. 2023) to keep the rewards
centred on zero. As in `_preference`, values come back per example so the caller can weight,
mask and average them itself; the batch mean of the per-example centring term is TRL's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posttrain.losses._preference import _as_float


def bradley_terry_loss(
    chosen_B: jax.Array,
    rejected_B: jax.Array,
    *,
    margin_B: jax.Array | None = None,
    center_coefficient: float = 0.0,
) -> dict[str, jax.Array]:
    """Per-example Bradley-Terry reward-model loss and metrics.

    `loss_i = -log sig(r_c - r_r - m_i) + center_coefficient * (r_c + r_r)^2`.

    Args:
      chosen_B: the reward model's score of each chosen response.
      rejected_B: its score of each rejected response.
      margin_B: how far the chosen should beat the rejected (e.g. from graded preference
        strengths, Llama 2 style); none means 0.
      center_coefficient: weight of the `(r_c + r_r)^2` penalty that centres the rewards (TRL's
        `center_rewards_coefficient`, 1e-2 in its docs); 0 turns it off.

    Returns:
      `[B]` arrays in at least float32: `losses`; with gradients stopped, `accuracies` (1.0 where
      `r_c > r_r` strictly, so ties count as wrong), `margins` (`r_c - r_r`), `rewards/chosen`
      and `rewards/rejected`.

    Raises:
      ValueError: a negative `center_coefficient`.
    """
    if not center_coefficient >= 0:
        raise ValueError(
            f"center_coefficient must be >= 0 (it weighs a squared penalty), got "
            f"{center_coefficient}; pass 0 to turn centring off."
        )
    r_c, r_r = _as_float(chosen_B), _as_float(rejected_B)
    logits = r_c - r_r
    if margin_B is not None:
        logits = logits - _as_float(margin_B)
    losses = -jax.nn.log_sigmoid(logits)
    if center_coefficient:
        losses = losses + center_coefficient * jnp.square(r_c + r_r)
    r_c, r_r = jax.lax.stop_gradient(r_c), jax.lax.stop_gradient(r_r)
    return {
        "losses": losses,
        "accuracies": (r_c > r_r).astype(losses.dtype),
        "margins": r_c - r_r,
        "rewards/chosen": r_c,
        "rewards/rejected": r_r,
    }
