"""Pairwise preference losses (DPO family, SimPO, ORPO) over sequence log-probs.

Every variant is one `loss_type` of `preference_loss`; the definitions follow TRL's
`DPOTrainer.dpo_loss`, `CPOTrainer.cpo_loss` and `ORPOTrainer.odds_ratio_loss`. Losses and
metrics come back per example so the caller can weight, mask and average them (per domain,
across micro-batches) itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

REFERENCE_BASED = ("sigmoid", "ipo", "hinge", "robust", "sppo_hard", "nca_pair")
REFERENCE_FREE = ("simpo", "orpo")
LOSS_TYPES = REFERENCE_BASED + REFERENCE_FREE
# Variants that score sequences by their mean per-token log-prob (TRL: `average_log_prob`).
LENGTH_NORMALISED = ("ipo", "simpo", "orpo")


def sequence_logps(
    token_logps_BL: jax.Array, mask_BL: jax.Array, average: bool = False
) -> jax.Array:
    """Per-sequence log-prob of the response tokens.

    Args:
      token_logps_BL: log p(token) at every position (e.g. from `token_log_probs`).
      mask_BL: 1 on response tokens, 0 on prompt and padding.
      average: divide by the number of response tokens (per-token mean, as IPO/SimPO/ORPO use);
        a sequence with no response tokens gets 0 rather than NaN.

    Returns:
      `[B]` summed (or averaged) log-probs.
    """
    token_logps = _as_float(token_logps_BL)
    mask = mask_BL.astype(token_logps.dtype)
    total_B = jnp.sum(token_logps * mask, axis=-1)
    if not average:
        return total_B
    return total_B / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)


def preference_loss(
    policy_chosen_logps_B: jax.Array,
    policy_rejected_logps_B: jax.Array,
    ref_chosen_logps_B: jax.Array | None = None,
    ref_rejected_logps_B: jax.Array | None = None,
    *,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    gamma: float = 0.0,
    chosen_lengths_B: jax.Array | None = None,
    rejected_lengths_B: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """Per-example pairwise preference loss and reward metrics.

    Notation: `a = pi_c - ref_c`, `b = pi_r - ref_r` (chosen / rejected log-ratios) and
    `h = a - b = (pi_c - pi_r) - (ref_c - ref_r)`; `eps = label_smoothing`.

    Reference-based (need `ref_*`; TRL `DPOTrainer.dpo_loss`):
      - `sigmoid`: DPO (Rafailov et al. 2023), with cDPO label smoothing (Mitchell 2023):
        `-(1 - eps) log sig(beta h) - eps log sig(-beta h)`.
      - `ipo`: IPO (Azar et al. 2023, eq. 17, `tau = beta`): `(h - 1 / (2 beta))^2`.
      - `hinge`: SLiC (Zhao et al. 2023): `relu(1 - beta h)`.
      - `robust`: Robust DPO (Chowdhury et al. 2024):
        `(-(1 - eps) log sig(beta h) + eps log sig(-beta h)) / (1 - 2 eps)`, `eps < 0.5`.
      - `sppo_hard`: SPPO with hard labels (Wu et al. 2024):
        `(a - 1 / (2 beta))^2 + (b + 1 / (2 beta))^2`.
      - `nca_pair`: NCA pairwise (Chen et al. 2024):
        `-log sig(beta a) - 0.5 log sig(-beta a) - 0.5 log sig(-beta b)`.
      Rewards are `beta * a` and `beta * b`.

    Reference-free (pass no `ref_*`):
      - `simpo`: SimPO (Meng et al. 2024) as TRL `CPOTrainer` (`loss_type="simpo"`), with
        `d = beta (pi_c - pi_r) - gamma`: `-(1 - eps) log sig(d) - eps log sig(-d)`.
      - `orpo`: ORPO (Hong et al. 2024) as TRL `ORPOTrainer.odds_ratio_loss`:
        `log_odds = (pi_c - pi_r) - (log(1 - exp(pi_c)) - log(1 - exp(pi_r)))`, loss term
        `-beta log sig(log_odds)`, to be ADDED to the chosen response's SFT NLL by the caller.
      Rewards are `beta * pi_c` and `beta * pi_r`.

    Length normalisation: TRL scores `ipo`, `simpo` and `orpo` with per-token mean log-probs.
    For these, pass summed log-probs together with `chosen_lengths_B` / `rejected_lengths_B`
    (response token counts) and every log-prob is divided by its length here, or pass log-probs
    already averaged (`sequence_logps(..., average=True)`) and no lengths. Other variants use
    summed log-probs as given; passing lengths to them is an error.

    Args:
      policy_chosen_logps_B: policy log-prob of each chosen response.
      policy_rejected_logps_B: policy log-prob of each rejected response.
      ref_chosen_logps_B: reference-model log-prob of each chosen response (reference-based).
      ref_rejected_logps_B: reference-model log-prob of each rejected response.
      loss_type: one of `LOSS_TYPES`.
      beta: inverse temperature (DPO beta; IPO tau; ORPO lambda).
      label_smoothing: assumed label-flip rate for `sigmoid`, `robust` and `simpo`.
      gamma: SimPO target reward margin.
      chosen_lengths_B: response token counts of the chosen, for length-normalised variants.
      rejected_lengths_B: response token counts of the rejected.

    Returns:
      `[B]` arrays: `losses`; `rewards/chosen`, `rewards/rejected`, `rewards/margins`
      (chosen - rejected), `rewards/accuracies` (1.0 where chosen reward > rejected), with
      gradients stopped; `logps/chosen`, `logps/rejected` (policy log-probs as scored). `orpo`
      also returns `log_odds_ratio` (`log sig(log_odds)`) and `log_odds_chosen` (`log_odds`).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"Unknown loss_type {loss_type!r}; valid loss types: {LOSS_TYPES}.")
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}.")
    if loss_type == "robust" and not 0 <= label_smoothing < 0.5:
        raise ValueError(
            f"loss_type='robust' needs 0 <= label_smoothing < 0.5, got {label_smoothing}."
        )
    has_lengths = (chosen_lengths_B is not None, rejected_lengths_B is not None)
    if any(has_lengths) and loss_type not in LENGTH_NORMALISED:
        raise ValueError(
            f"chosen_lengths_B/rejected_lengths_B apply only to {LENGTH_NORMALISED}, "
            f"not loss_type={loss_type!r}; pass summed log-probs and no lengths."
        )
    if any(has_lengths) and not all(has_lengths):
        raise ValueError("Pass both chosen_lengths_B and rejected_lengths_B, or neither.")
    refs = {"ref_chosen_logps_B": ref_chosen_logps_B, "ref_rejected_logps_B": ref_rejected_logps_B}
    if loss_type in REFERENCE_BASED:
        missing = [name for name, value in refs.items() if value is None]
        if missing:
            raise ValueError(
                f"loss_type={loss_type!r} is reference-based; pass {', '.join(missing)}."
            )
    elif any(value is not None for value in refs.values()):
        raise ValueError(f"loss_type={loss_type!r} is reference-free; pass no ref_*_logps_B.")

    pi_c, pi_r = _as_float(policy_chosen_logps_B), _as_float(policy_rejected_logps_B)
    ref_c = None if ref_chosen_logps_B is None else _as_float(ref_chosen_logps_B)
    ref_r = None if ref_rejected_logps_B is None else _as_float(ref_rejected_logps_B)
    if all(has_lengths):
        len_c = jnp.maximum(_as_float(chosen_lengths_B), 1.0)
        len_r = jnp.maximum(_as_float(rejected_lengths_B), 1.0)
        pi_c, pi_r = pi_c / len_c, pi_r / len_r
        if ref_c is not None:
            ref_c, ref_r = ref_c / len_c, ref_r / len_r

    eps = label_smoothing
    out = {}
    if loss_type in REFERENCE_BASED:
        a, b = pi_c - ref_c, pi_r - ref_r
        h = a - b
        if loss_type == "sigmoid":
            losses = -(1 - eps) * jax.nn.log_sigmoid(beta * h) - eps * jax.nn.log_sigmoid(-beta * h)
        elif loss_type == "ipo":
            losses = jnp.square(h - 1 / (2 * beta))
        elif loss_type == "hinge":
            losses = jax.nn.relu(1 - beta * h)
        elif loss_type == "robust":
            losses = (
                -(1 - eps) * jax.nn.log_sigmoid(beta * h) + eps * jax.nn.log_sigmoid(-beta * h)
            ) / (1 - 2 * eps)
        elif loss_type == "sppo_hard":
            losses = jnp.square(a - 1 / (2 * beta)) + jnp.square(b + 1 / (2 * beta))
        else:  # nca_pair
            losses = (
                -jax.nn.log_sigmoid(beta * a)
                - 0.5 * jax.nn.log_sigmoid(-beta * a)
                - 0.5 * jax.nn.log_sigmoid(-beta * b)
            )
        chosen_rewards, rejected_rewards = beta * a, beta * b
    else:
        if loss_type == "simpo":
            d = beta * (pi_c - pi_r) - gamma
            losses = -(1 - eps) * jax.nn.log_sigmoid(d) - eps * jax.nn.log_sigmoid(-d)
        else:  # orpo
            log_odds = (pi_c - pi_r) - (_log1mexp(pi_c) - _log1mexp(pi_r))
            log_odds_ratio = jax.nn.log_sigmoid(log_odds)
            losses = -beta * log_odds_ratio
            out["log_odds_ratio"] = jax.lax.stop_gradient(log_odds_ratio)
            out["log_odds_chosen"] = jax.lax.stop_gradient(log_odds)
        chosen_rewards, rejected_rewards = beta * pi_c, beta * pi_r

    chosen_rewards = jax.lax.stop_gradient(chosen_rewards)
    rejected_rewards = jax.lax.stop_gradient(rejected_rewards)
    return {
        "losses": losses,
        "rewards/chosen": chosen_rewards,
        "rewards/rejected": rejected_rewards,
        "rewards/margins": chosen_rewards - rejected_rewards,
        "rewards/accuracies": (chosen_rewards > rejected_rewards).astype(losses.dtype),
        "logps/chosen": jax.lax.stop_gradient(pi_c),
        "logps/rejected": jax.lax.stop_gradient(pi_r),
        **out,
    }


def _as_float(x: jax.Array) -> jax.Array:
    """At least float32 (bf16 log-probs lose the small differences DPO is made of)."""
    x = jnp.asarray(x)
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _log1mexp(x: jax.Array) -> jax.Array:
    """log(1 - exp(x)) for x < 0, accurate near 0 and far below it (Maechler 2012)."""
    return jnp.where(x > -jnp.log(2.0), jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))
