"""Offline RL losses over logged trajectories: advantage-weighted regression and an
importance-sampled policy gradient against the logged behaviour policy.

Both are per-token losses `[B, L]` (0 off the mask) for `aggregate`, with advantages `[B]`
computed beforehand from the logged rewards (`A = reward - baseline`):

- AWR (Peng et al. 2019, "Advantage-Weighted Regression"): supervised learning of the logged
  completions, each weighted by `w = min(exp(A / beta), max_weight)`; the per-token loss is
  `-w * logp`. No behaviour log-probs are needed: the exponential weight is the closed-form
  solution of the KL-constrained improvement over the behaviour policy.
- Truncated IS (offline GRPO): the GRPO policy gradient from logged samples, each token's
  gradient `-w A grad logp` scaled by the stop-gradient weight `w = min(pi / mu, cap)`, `pi`
  the policy being trained and `mu` the logged behaviour policy (token ratios, or the
  per-token geometric mean of the row's ratio when only the completion's total log-prob was
  logged), as `rollout_correction`'s `truncate` mode computes it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posttrain.losses._correction import rollout_correction
from posttrain.losses._preference import _as_float


def awr_loss(
    logp_BL: jax.Array,
    advantages_B: jax.Array,
    mask_BL: jax.Array,
    *,
    beta: float,
    max_weight: float,
) -> dict[str, jax.Array]:
    """Advantage-weighted regression's per-token loss `-w_b logp_bt`.

    Args:
      logp_BL: log-probs of the logged completion tokens under the policy being trained.
      advantages_B: one advantage per completion (reward minus its baseline).
      mask_BL: 1 on the completion's trained tokens.
      beta: the temperature (in reward units): smaller sharpens the weights.
      max_weight: the weight's cap (AWR's `w_max`), which bounds the variance.

    Returns:
      `losses` float32 `[B, L]` (0 off the mask), and with gradients stopped `weights` `[B]`
      (`min(exp(A / beta), max_weight)`) and `clipped` `[B]` (1 where the cap bound).
    """
    if not (beta > 0 and max_weight > 0):
        raise ValueError(f"awr_loss needs beta > 0 and max_weight > 0, got {beta}, {max_weight}.")
    mask = mask_BL.astype(bool)
    scaled_B = _as_float(advantages_B) / beta
    log_cap = jnp.log(jnp.float32(max_weight))
    # exp of the capped exponent: a huge advantage cannot overflow to inf
    weights_B = jnp.minimum(jnp.exp(jnp.minimum(scaled_B, log_cap)), max_weight)
    weights_B = jax.lax.stop_gradient(weights_B)
    logp = jnp.where(mask, _as_float(logp_BL), 0.0)
    return {
        "losses": -weights_B[:, None] * logp,
        "weights": weights_B,
        "clipped": jax.lax.stop_gradient((scaled_B >= log_cap).astype(jnp.float32)),
    }


def truncated_is_loss(
    logp_BL: jax.Array,
    behaviour_logp_BL: jax.Array,
    advantages_B: jax.Array,
    mask_BL: jax.Array,
    *,
    cap: float,
    geometric_B: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """The policy-gradient loss of logged samples with truncated importance weights.

    Per token `-w A exp(logp - sg(logp))`: its value is `-w A` and its gradient `-w A grad
    logp`, with `w = min(r, cap)` (no gradient) and `r = exp(logp - behaviour_logp)`; rows
    with `geometric_B` set use the row's geometric-mean ratio `exp(mean_t(logp - behaviour))`
    on every token instead (their behaviour log-prob is known only as a total, spread evenly).

    Args:
      logp_BL: log-probs of the logged tokens under the policy being trained.
      behaviour_logp_BL: the logged behaviour policy's log-probs of the same tokens.
      advantages_B: one advantage per completion.
      mask_BL: 1 on the completion's trained tokens.
      cap: the weight's truncation (> 0).
      geometric_B: 1 on rows whose ratio is the geometric mean; None: none is.

    Returns:
      float32 `[B, L]`, 0 off the mask: `losses`, and with gradients stopped `weights` (`w`),
      `ratio` (`r`, or the row's geometric mean) and `clipped` (1 where `r > cap`).
    """
    mask = mask_BL.astype(bool)
    mask_f = mask.astype(jnp.float32)
    logp = jnp.where(mask, _as_float(logp_BL), 0.0)
    token = rollout_correction(logp, behaviour_logp_BL, mask_BL, level="token", cap=cap)
    ratio, weights = token["ratio"], token["weights"]
    if geometric_B is not None:
        row = rollout_correction(logp, behaviour_logp_BL, mask_BL, level="geometric", cap=cap)
        geometric = (_as_float(geometric_B) > 0)[:, None]
        ratio = jnp.where(geometric, row["ratio"], ratio)
        weights = jnp.where(geometric, row["weights"], weights)
    adv_BL = jax.lax.stop_gradient(_as_float(advantages_B))[:, None] * mask_f
    surrogate = jnp.exp(logp - jax.lax.stop_gradient(logp))
    return {
        "losses": -weights * adv_BL * surrogate * mask_f,
        "weights": weights,
        "ratio": ratio,
        "clipped": (ratio > cap).astype(jnp.float32) * mask_f,
    }
