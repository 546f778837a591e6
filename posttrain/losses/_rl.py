"""RL losses: group advantages, GAE, clipped policy and value losses, KL estimates, entropy.

One `policy_loss` covers the GRPO family and PPO; each paper is a choice of its arguments:

- GRPO (Shao et al. 2024): `group_advantages(mode="grpo")`, token ratio, symmetric clip,
  `aggregate(mode="seq-mean-token-mean")`, plus `beta * kl_estimate(kind="k3")` per token.
- Dr.GRPO (Liu et al. 2025): `mode="drgrpo"` advantages, `"seq-mean-token-sum-norm"`.
- DAPO (Yu et al. 2025): `clip_high > clip_low` (clip-higher), `"token-mean"`; its over-length
  reward shaping is `posttrain.rewards.overlong_penalty`.
- GSPO (Zheng et al. 2025): `ratio="sequence"` with small clip ranges (3e-4 / 4e-4).
- RLOO (Ahmadian et al. 2024): `mode="rloo"` advantages.
- PPO (Schulman et al. 2017) with a critic: `gae` + `whiten` advantages, `value_loss`,
  optionally `dual_clip` (Ye et al. 2020) and an adaptive KL coefficient (Ziegler et al. 2019).

Token arrays are `[B, L]` (`B` rollouts, `L` response tokens, right-padded) with a mask that is
1 on trained tokens; masked positions may hold anything (even inf) and come back as 0, with
finite gradients. Per-token losses are reduced by `aggregate`, which returns a sum and its
normaliser separately so micro-batches and data-parallel shards add up before one division.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posttrain.losses._preference import _as_float

ADVANTAGE_MODES = ("grpo", "drgrpo", "rloo", "none")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3")
RATIO_LEVELS = ("token", "sequence")
# Log-ratios are clamped here before exp (as verl does) so a stale or broken token cannot
# overflow float32 into inf, whose 0 * inf backward would be NaN.
_MAX_LOG_RATIO = 20.0


def group_advantages(
    rewards_B: jax.Array,
    group_size: int,
    *,
    mode: str = "grpo",
    unbiased_std: bool = True,
    std_eps: float = 1e-4,
) -> jax.Array:
    """Per-rollout advantages from the rewards of the other rollouts of the same prompt.

    Rows `[k * G, (k + 1) * G)` are the `G = group_size` rollouts of prompt `k`. With `m`, `s`
    the group's reward mean and standard deviation:

    - `grpo`: `(r - m) / (s + std_eps)` (Shao et al. 2024; TRL `GRPOTrainer`, whose
      `torch.std` is unbiased, hence the default `unbiased_std=True`, and `std_eps=1e-4`).
    - `drgrpo`: `r - m`, no std scaling (Liu et al. 2025).
    - `rloo`: `r_i - mean_{j != i} r_j` (Ahmadian et al. 2024); needs `G >= 2`.
    - `none`: the raw rewards.

    A group whose rewards are all equal carries no signal and gets exactly 0 in the centred
    modes (not NaN, not rounding noise).

    Args:
      rewards_B: scalar reward of each rollout, `B = num_prompts * G`.
      group_size: rollouts per prompt, `G`.
      mode: one of `ADVANTAGE_MODES`.
      unbiased_std: `grpo` divides the squared deviations by `G - 1` (True) or `G`.
      std_eps: added to the std before dividing (`grpo`).

    Returns:
      `[B]` float32 advantages.
    """
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"Unknown advantage mode {mode!r}; valid modes: {ADVANTAGE_MODES}.")
    rewards = _as_float(rewards_B)
    (batch,) = rewards.shape
    if group_size < 1 or batch % group_size:
        raise ValueError(
            f"{batch} rewards do not split into groups of group_size={group_size}; the batch "
            "must hold every rollout of each prompt, consecutively."
        )
    if mode == "none":
        return rewards
    if mode == "rloo" and group_size < 2:
        raise ValueError("mode='rloo' needs group_size >= 2 (a baseline from the other rollouts).")
    r_PG = rewards.reshape(-1, group_size)
    mean_P1 = jnp.mean(r_PG, axis=-1, keepdims=True)
    if mode == "grpo":
        dof = group_size - 1 if unbiased_std and group_size > 1 else group_size
        std_P1 = jnp.sqrt(jnp.sum(jnp.square(r_PG - mean_P1), axis=-1, keepdims=True) / dof)
        adv_PG = (r_PG - mean_P1) / (std_P1 + std_eps)
    elif mode == "drgrpo":
        adv_PG = r_PG - mean_P1
    else:  # rloo: r_i - (sum - r_i) / (G - 1) == G / (G - 1) * (r_i - mean)
        adv_PG = (r_PG - mean_P1) * (group_size / (group_size - 1))
    constant_P1 = jnp.max(r_PG, axis=-1, keepdims=True) == jnp.min(r_PG, axis=-1, keepdims=True)
    return jnp.where(constant_P1, 0.0, adv_PG).reshape(batch)


def gae(
    rewards_BL: jax.Array,
    values_BL: jax.Array,
    mask_BL: jax.Array,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation (Schulman et al. 2016) over response tokens.

    `delta_t = r_t + gamma V_{t+1} - V_t`, `A_t = delta_t + gamma lam A_{t+1}`, where `t + 1` is
    the next valid token and the value after a sequence's last valid token is 0. Masked tokens
    are skipped as in verl (an interleaved tool output does not break the chain) and their
    rewards are ignored: put the outcome reward on the last valid token.

    Args:
      rewards_BL: per-token rewards (usually 0 except the last token, minus any KL penalty).
      values_BL: the critic's values at rollout time.
      mask_BL: 1 on response tokens.
      gamma: discount.
      lam: GAE lambda (1 gives Monte-Carlo returns minus values, 0 the one-step TD error).

    Returns:
      `(advantages_BL, returns_BL)`, float32, `returns = advantages + values`, both 0 on masked
      tokens and with gradients stopped (they are targets).
    """
    mask = mask_BL.astype(bool)
    rewards = jnp.where(mask, _as_float(rewards_BL), 0.0)
    values = jnp.where(mask, _as_float(values_BL), 0.0)

    def step(carry, xs):
        next_value_B, next_adv_B = carry
        reward_B, value_B, mask_B = xs
        adv_B = reward_B + gamma * next_value_B - value_B + gamma * lam * next_adv_B
        carry = (jnp.where(mask_B, value_B, next_value_B), jnp.where(mask_B, adv_B, next_adv_B))
        return carry, jnp.where(mask_B, adv_B, 0.0)

    zeros_B = jnp.zeros(rewards.shape[:1], rewards.dtype)
    _, adv_LB = jax.lax.scan(step, (zeros_B, zeros_B), (rewards.T, values.T, mask.T), reverse=True)
    advantages = jax.lax.stop_gradient(adv_LB.T)
    returns = jax.lax.stop_gradient(jnp.where(mask, advantages + values, 0.0))
    return advantages, returns


def whiten(
    x_BL: jax.Array, mask_BL: jax.Array, shift_mean: bool = True, eps: float = 1e-8
) -> jax.Array:
    """Masked whitening, as TRL/verl `masked_whiten` (PPO advantage normalisation).

    `(x - mean) / sqrt(var + eps)` with the mean and unbiased variance over the masked
    entries of the whole batch; `shift_mean=False` adds the mean back (scales only).

    Args:
      x_BL: values to whiten (advantages).
      mask_BL: 1 on the entries that count.
      shift_mean: centre on 0 (True) or keep the original mean (False).
      eps: added to the variance.

    Returns:
      float32 `[B, L]`, 0 on masked entries.
    """
    mask = mask_BL.astype(bool)
    x = jnp.where(mask, _as_float(x_BL), 0.0)
    count = jnp.sum(mask)
    mean = jnp.sum(x) / jnp.maximum(count, 1)
    centred = jnp.where(mask, x - mean, 0.0)
    var = jnp.sum(jnp.square(centred)) / jnp.maximum(count - 1, 1)
    out = centred * jax.lax.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return jnp.where(mask, out, 0.0)


def policy_loss(
    logp_BL: jax.Array,
    old_logp_BL: jax.Array,
    advantages: jax.Array,
    mask_BL: jax.Array,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    ratio: str = "token",
    is_weights_BL: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """Per-token clipped surrogate loss (PPO / GRPO / DAPO / GSPO), to be minimised.

    With ratio `w` and advantage `A`: `loss = max(-A w, -A clip(w, 1 - clip_low, 1 + clip_high))`
    (the negated PPO objective). `ratio="token"`: `w_t = exp(logp_t - old_logp_t)`.
    `ratio="sequence"` (GSPO-token, Zheng et al. 2025, eq. 13-14): `w_t = sg(s) exp(logp_t -
    sg(logp_t))` with `s = exp(mean over valid tokens of (logp - old_logp))`, so every token
    carries the value `s` and the gradient `s grad logp_t`; with one advantage per sequence and
    `"seq-mean-token-mean"` aggregation this is exactly GSPO's sequence objective. Log-ratios
    (per token, or the sequence mean) are clamped to +-20 before the exp, as in verl.

    `dual_clip = c > 1` (Ye et al. 2020; verl `compute_policy_loss` `clip_ratio_c`): where
    `A < 0` the loss is further capped, `min(loss, -c A)`, so a huge ratio on a bad token cannot
    blow up the update. Positive advantages are untouched.

    Off-policy corrections (`rollout_correction`: truncated, masked or rejection importance
    sampling against the sampler's log-probs, which differ from the trainer's `old_logp_BL` by
    engine mismatch or staleness): each token's loss is multiplied by `is_weights_BL`, with
    gradients stopped.

    Args:
      logp_BL: log-probs of the sampled tokens under the policy being trained.
      old_logp_BL: the same under the policy that the clip is anchored to (no gradient).
      advantages: `[B]` (one per sequence, broadcast over tokens) or `[B, L]`.
      mask_BL: 1 on trained response tokens.
      clip_low: lower clip range, `w >= 1 - clip_low`.
      clip_high: upper clip range, `w <= 1 + clip_high`; None means `clip_low` (symmetric).
      dual_clip: the dual-clip constant `c > 1`, or None for none.
      ratio: one of `RATIO_LEVELS`.
      is_weights_BL: per-token importance weights (`rollout_correction(...)["weights"]`), or
        None for none.

    Returns:
      float32 `[B, L]` arrays, all 0 on masked tokens: `losses` (differentiable); with gradients
      stopped, per-token metrics to be averaged with the mask: `ratio` (`w`), `clipped` (1 where
      the clipped branch is taken, so the token has no gradient), `clipped_low` (`A < 0` and
      `w < 1 - clip_low`), `clipped_high` (`A > 0` and `w > 1 + clip_high`), `approx_kl` (k3
      estimate of KL(old || new)); `dual_clipped` with `dual_clip`.
    """
    clip_high = clip_low if clip_high is None else clip_high
    if ratio not in RATIO_LEVELS:
        raise ValueError(f"Unknown ratio {ratio!r}; valid ratios: {RATIO_LEVELS}.")
    if not (0 <= clip_low < 1 and clip_high >= 0):
        raise ValueError(
            f"policy_loss needs 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}."
        )
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1 (or None for off), got {dual_clip}.")

    mask = mask_BL.astype(bool)
    mask_f = mask.astype(jnp.float32)
    # Sanitise padding first so that inf or NaN there reaches neither values nor gradients.
    logp = jnp.where(mask, _as_float(logp_BL), 0.0)
    old_logp = jax.lax.stop_gradient(jnp.where(mask, _as_float(old_logp_BL), 0.0))
    adv = _as_float(advantages)
    adv_BL = jnp.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, logp.shape)
    adv_BL = jax.lax.stop_gradient(jnp.where(mask, adv_BL, 0.0))

    log_ratio = logp - old_logp
    if ratio == "token":
        log_w = jnp.clip(log_ratio, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    else:
        num_tokens_B = jnp.maximum(jnp.sum(mask_f, axis=-1), 1.0)
        log_s_B = jnp.sum(log_ratio, axis=-1) / num_tokens_B
        log_s_B = jax.lax.stop_gradient(jnp.clip(log_s_B, -_MAX_LOG_RATIO, _MAX_LOG_RATIO))
        log_w = log_s_B[:, None] + logp - jax.lax.stop_gradient(logp)
    w = jnp.exp(log_w)
    w_clipped = jnp.clip(w, 1.0 - clip_low, 1.0 + clip_high)
    loss_unclipped, loss_clipped = -adv_BL * w, -adv_BL * w_clipped
    losses = jnp.maximum(loss_unclipped, loss_clipped)
    metrics = {"clipped": loss_clipped > loss_unclipped}
    if dual_clip is not None:
        loss_cap = -adv_BL * dual_clip
        metrics["dual_clipped"] = (adv_BL < 0) & (losses > loss_cap)
        losses = jnp.where(adv_BL < 0, jnp.minimum(losses, loss_cap), losses)
    if is_weights_BL is not None:
        weights = jnp.where(mask, _as_float(is_weights_BL), 0.0)
        losses = losses * jax.lax.stop_gradient(weights)
    w = jax.lax.stop_gradient(w)
    metrics["clipped_low"] = (adv_BL < 0) & (w < 1.0 - clip_low)
    metrics["clipped_high"] = (adv_BL > 0) & (w > 1.0 + clip_high)
    metrics["ratio"] = w
    metrics["approx_kl"] = jax.lax.stop_gradient(jnp.expm1(log_w) - log_w)
    out = {"losses": losses * mask_f}
    for key, value in metrics.items():
        out[key] = jax.lax.stop_gradient(value.astype(jnp.float32) * mask_f)
    return out


def aggregate(
    loss_BL: jax.Array, mask_BL: jax.Array, mode: str, *, max_len: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """Reduce per-token losses to a `(numerator, denominator)` pair; the loss is their ratio.

    Both are sums over rows, so numerators and denominators from micro-batches and shards add
    up and one division by the global denominator gives the loss of the whole batch (not a mean
    of means). With `n_i` the valid tokens of row `i`:

    - `token-mean` (DAPO): numerator `sum_i sum_t l`; denominator: number of valid tokens.
    - `seq-mean-token-mean` (GRPO): numerator `sum_i (sum_t l) / n_i`; denominator: number
      of sequences with `n_i > 0`.
    - `seq-mean-token-sum-norm` (Dr.GRPO): numerator `sum_i (sum_t l) / max_len`; denominator:
      number of sequences with `n_i > 0`.

    Rows with no valid token add 0 to both (so padding rows are not counted).

    Args:
      loss_BL: per-token losses (e.g. `policy_loss(...)["losses"]`).
      mask_BL: 1 on valid tokens.
      mode: one of `AGGREGATIONS`.
      max_len: the constant token normaliser of `seq-mean-token-sum-norm` (the generation
        budget, the same for every micro-batch); required there, unused elsewhere.

    Returns:
      `(numerator, denominator)`, float32 scalars.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"Unknown aggregation {mode!r}; valid modes: {AGGREGATIONS}.")
    if mode == "seq-mean-token-sum-norm" and (max_len is None or max_len <= 0):
        raise ValueError(
            f"aggregation {mode!r} needs max_len > 0 (the fixed generation budget), got {max_len}."
        )
    mask = mask_BL.astype(bool)
    loss = jnp.where(mask, _as_float(loss_BL), 0.0)
    num_tokens_B = jnp.sum(mask, axis=-1).astype(loss.dtype)
    if mode == "token-mean":
        return jnp.sum(loss), jnp.sum(num_tokens_B)
    row_sums_B = jnp.sum(loss, axis=-1)
    num_sequences = jnp.sum(num_tokens_B > 0).astype(loss.dtype)
    if mode == "seq-mean-token-mean":
        return jnp.sum(row_sums_B / jnp.maximum(num_tokens_B, 1.0)), num_sequences
    return jnp.sum(row_sums_B) / max_len, num_sequences


def kl_estimate(
    logp_BL: jax.Array,
    ref_logp_BL: jax.Array,
    kind: str = "k3",
    mask_BL: jax.Array | None = None,
) -> jax.Array:
    """Per-token estimate of KL(policy || ref) from tokens sampled from the policy.

    With `d = ref_logp - logp` (Schulman 2020, "Approximating KL divergence"):
    `k1 = -d` (unbiased, high variance, can be negative), `k2 = d^2 / 2` (biased, low
    variance), `k3 = exp(d) - d - 1` (unbiased, low variance, >= 0; GRPO's penalty). For `k3`,
    `d` is clamped to +-20 before the exp, as verl does, so it cannot overflow.

    Args:
      logp_BL: log-probs of the sampled tokens under the policy.
      ref_logp_BL: the same under the reference model.
      kind: one of `KL_KINDS`.
      mask_BL: optional; masked positions return 0 whatever they hold.

    Returns:
      float32 `[B, L]`, differentiable with respect to both inputs.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"Unknown KL estimator {kind!r}; valid kinds: {KL_KINDS}.")
    logp, ref_logp = _as_float(logp_BL), _as_float(ref_logp_BL)
    if mask_BL is not None:
        mask = mask_BL.astype(bool)
        logp, ref_logp = jnp.where(mask, logp, 0.0), jnp.where(mask, ref_logp, 0.0)
    d = ref_logp - logp
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * jnp.square(d)
    d = jnp.clip(d, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return jnp.expm1(d) - d


def adaptive_kl_update(
    coef: float | jax.Array,
    observed_kl: float | jax.Array,
    *,
    target: float,
    horizon: float,
    n_steps: int | jax.Array,
) -> jax.Array:
    """One update of the adaptive KL coefficient (Ziegler et al. 2019; TRL `AdaptiveKLController`).

    `e = clip(observed_kl / target - 1, -0.2, 0.2)`; `coef * (1 + e * n_steps / horizon)`. A
    fixed coefficient needs no update: keep using `coef`.

    Args:
      coef: the current KL coefficient (beta).
      observed_kl: the KL measured over the last batch (per sequence, as in the paper).
      target: the KL to steer towards.
      horizon: how many samples the correction is spread over (10000 in the paper).
      n_steps: samples seen since the last update (the batch size).

    Returns:
      The new coefficient, float32 scalar (jittable; `float()` it on the host if needed).
    """
    if not (target > 0 and horizon > 0):
        raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got {target}, {horizon}.")
    error = jnp.clip(_as_float(observed_kl) / target - 1.0, -0.2, 0.2)
    return _as_float(coef) * (1.0 + error * n_steps / horizon)


def value_loss(
    values_BL: jax.Array,
    old_values_BL: jax.Array,
    returns_BL: jax.Array,
    mask_BL: jax.Array,
    *,
    clip: float | None = 0.2,
) -> dict[str, jax.Array]:
    """Per-token clipped value loss of PPO's critic.

    `0.5 * max((v - R)^2, (clip(v, v_old - clip, v_old + clip) - R)^2)` (the PPO2 baseline and
    verl `compute_value_loss`); `clip=None` gives the plain `0.5 * (v - R)^2`.

    Args:
      values_BL: the critic's current values.
      old_values_BL: its values at rollout time (no gradient).
      returns_BL: the targets (e.g. from `gae`; no gradient).
      mask_BL: 1 on response tokens.
      clip: how far a value may move from `old_values_BL` before its gradient stops, or None.

    Returns:
      float32 `[B, L]`, 0 on masked tokens: `losses`, and `clipped` (1 where the clipped term is
      the larger, gradient stopped), to be aggregated with the mask.
    """
    if clip is not None and not clip > 0:
        raise ValueError(f"value clip must be > 0 (or None for off), got {clip}.")
    mask = mask_BL.astype(bool)
    mask_f = mask.astype(jnp.float32)
    values = jnp.where(mask, _as_float(values_BL), 0.0)
    old_values = jax.lax.stop_gradient(jnp.where(mask, _as_float(old_values_BL), 0.0))
    returns = jax.lax.stop_gradient(jnp.where(mask, _as_float(returns_BL), 0.0))
    loss_unclipped = jnp.square(values - returns)
    if clip is None:
        return {"losses": 0.5 * loss_unclipped * mask_f, "clipped": jnp.zeros_like(mask_f)}
    values_clipped = jnp.clip(values, old_values - clip, old_values + clip)
    loss_clipped = jnp.square(values_clipped - returns)
    return {
        "losses": 0.5 * jnp.maximum(loss_unclipped, loss_clipped) * mask_f,
        "clipped": jax.lax.stop_gradient((loss_clipped > loss_unclipped) * mask_f),
    }


def entropy_from_logits(logits_BLV: jax.Array) -> jax.Array:
    """Per-token entropy of the softmax of `logits_BLV`, float32 `[B, L]`.

    `logsumexp(l) - sum_v p_v l_v`; `-inf` logits (top-k / top-p masking) count as probability 0
    with finite gradients.
    """
    logits = logits_BLV.astype(jnp.float32)
    # Shift by the max first: `lse - sum p l` of raw logits cancels two large numbers.
    logits = logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    probs = jax.nn.softmax(logits, axis=-1)
    finite_logits = jnp.where(jnp.isfinite(logits), logits, 0.0)
    return jax.nn.logsumexp(logits, axis=-1) - jnp.sum(probs * finite_logits, axis=-1)
