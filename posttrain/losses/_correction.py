"""Off-policy corrections: importance weights and masks for tokens the sampler drew from a
policy other than the one the trainer anchors its ratio to.

The sampler's log-probs `q` differ from the trainer's old-policy log-probs `p` of the same
tokens by engine mismatch (a different kernel, batch or precision computed them) and by
staleness (decoupled rollouts sampled with older weights). With the token ratio
`r_t = exp(p_t - q_t)` and a sequence ratio at one of three levels:

- `token`: `r_t` itself;
- `sequence`: `R = exp(sum_t log r_t)` over the row's valid tokens (the exact sequence IS
  ratio; Zheng et al. 2025, verl `rollout_is="sequence"`);
- `geometric`: `R = exp(mean_t log r_t)`, the per-token geometric mean (length-independent,
  verl's geometric rejection sampling),

a correction mode turns the ratio into a per-token weight `w` (stop-gradient) and a keep mask:

- `truncate`: `w = min(ratio, cap)`, every token kept (truncated IS, TIS; Yao et al. 2025);
- `mask`: `w = ratio` where `low <= ratio <= high`, else the token (or row) is dropped (masked
  IS; at the token level this is IcePop's two-sided calibration, Ling Team 2025);
- `reject`: `w = 1` where `low <= ratio <= high`, else dropped (rejection: no reweighting).

Dropped tokens leave the loss mask, so they count in neither the loss nor its normaliser, as
if they had not been sampled. Log-ratios are clamped to +-20 before the exp (as everywhere in
`posttrain.losses`), so a broken token cannot overflow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posttrain.losses._preference import _as_float

CORRECTION_LEVELS = ("token", "sequence", "geometric")
CORRECTION_MODES = ("truncate", "mask", "reject")
_MAX_LOG_RATIO = 20.0


def rollout_correction(
    old_logp_BL: jax.Array,
    rollout_logp_BL: jax.Array,
    mask_BL: jax.Array,
    *,
    level: str = "token",
    mode: str = "truncate",
    cap: float | None = None,
    low: float | None = None,
    high: float | None = None,
) -> dict[str, jax.Array]:
    """Per-token importance weights and keep mask for the sampler/trainer mismatch.

    Args:
      old_logp_BL: the trainer's log-probs of the sampled tokens (the ratio's numerator).
      rollout_logp_BL: the sampler's log-probs of the same tokens.
      mask_BL: 1 on sampled (trained) tokens; masked positions may hold anything.
      level: one of `CORRECTION_LEVELS`.
      mode: one of `CORRECTION_MODES`.
      cap: `truncate`'s cap (> 0).
      low, high: `mask` and `reject` bounds, `0 <= low <= 1 <= high`.

    Returns:
      float32 `[B, L]` arrays, all with gradients stopped and 0 off the mask: `weights` (0 on
      dropped tokens), `kept` (1 on tokens that stay in the loss), `ratio` (the ratio the
      mode compared: `r_t`, or the row's `R` on each of its tokens) and `token_ratio` (`r_t`).
    """
    if level not in CORRECTION_LEVELS:
        raise ValueError(f"Unknown correction level {level!r}; valid levels: {CORRECTION_LEVELS}.")
    if mode not in CORRECTION_MODES:
        raise ValueError(f"Unknown correction mode {mode!r}; valid modes: {CORRECTION_MODES}.")
    if mode == "truncate" and not (cap is not None and cap > 0):
        raise ValueError(f"the truncate correction needs cap > 0, got {cap}.")
    if mode != "truncate" and not (low is not None and high is not None and 0 <= low <= 1 <= high):
        raise ValueError(f"the {mode} correction needs 0 <= low <= 1 <= high, got {low}, {high}.")
    mask = mask_BL.astype(bool)
    mask_f = mask.astype(jnp.float32)
    log_r = jnp.where(mask, _as_float(old_logp_BL) - _as_float(rollout_logp_BL), 0.0)
    log_r = jax.lax.stop_gradient(log_r)
    if level == "token":
        log_ratio = log_r
    else:
        log_R_B = jnp.sum(log_r, axis=-1)
        if level == "geometric":
            log_R_B = log_R_B / jnp.maximum(jnp.sum(mask_f, axis=-1), 1.0)
        log_ratio = jnp.broadcast_to(log_R_B[:, None], log_r.shape)
    ratio = jnp.exp(jnp.clip(log_ratio, -_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    if mode == "truncate":
        kept = mask_f
        weights = jnp.minimum(ratio, cap)
    else:
        kept = mask_f * ((ratio >= low) & (ratio <= high))
        weights = ratio if mode == "mask" else jnp.ones_like(ratio)
    token_ratio = jnp.exp(jnp.clip(log_r, -_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    return {
        "weights": weights * kept,
        "kept": kept,
        "ratio": ratio * mask_f,
        "token_ratio": token_ratio * mask_f,
    }
