"""The RL policy loss as a `loss_fn(params, batch, rng) -> sums` for the shared train step.

The batch is a `rollout_batch` plus what the trainer computed before the update:
`old_logps` (the trainer's log-probs of the sampled tokens under the weights that sampled
them), `ref_logps` (the frozen reference's, when KL is used), `advantages [B]` and
`kl_coefs [B]` (per row, so that per-domain and adaptive coefficients are data, not
recompiles). `loss_sum / num_tokens` is the aggregation mode's numerator and normaliser, added
over micro-batches and data-parallel shards before the one division, so splitting the batch
never changes the loss or its gradient.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from posttrain.lora import Policy
from posttrain.losses import (
    AGGREGATIONS,
    CORRECTION_LEVELS,
    CORRECTION_MODES,
    KL_KINDS,
    RATIO_LEVELS,
    aggregate,
    kl_estimate,
    policy_loss,
    rollout_correction,
    token_stats,
    value_loss,
)
from posttrain.models import ModelConfig, hidden_states
from posttrain.rl._replay import REPLAY_MODES, replay_kwargs, router_mismatch
from posttrain.train import add_moe_aux


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """The clipped policy-gradient loss (GRPO, Dr.GRPO, DAPO, GSPO, RLOO are settings of it)."""

    clip_low: float = 0.2  # ratio clipped below at 1 - clip_low
    clip_high: float = 0.2  # ... and above at 1 + clip_high (DAPO: 0.28)
    dual_clip: float = 0.0  # > 1: cap the loss of negative-advantage tokens at -c A (0: off)
    ratio: str = "token"  # token (GRPO/PPO) | sequence (GSPO)
    aggregation: str = (
        "seq-mean-token-mean"  # token-mean (DAPO) | seq-mean-token-sum-norm (Dr.GRPO)
    )
    mask_truncated: bool = False  # DAPO: no loss on completions cut at max_new_tokens
    kl_estimator: str = "k3"  # k1 | k2 | k3, against the frozen reference
    entropy_coef: float = 0.0  # entropy bonus (the entropy is always logged)
    # Off-policy correction against the sampler's log-probs (docs/rl.md): the ratio's level,
    # off | token | sequence | geometric, and what it does: truncate (weight min(ratio,
    # tis_cap): TIS) | mask (weight ratio, dropped outside [is_low, is_high]: IcePop at the
    # token level) | reject (weight 1, dropped outside the bounds).
    correction: str = "off"
    correction_mode: str = "truncate"
    tis_cap: float = 0.0  # truncate's cap of the importance weight
    is_low: float = 0.5  # mask / reject: tokens (rows) whose ratio is below are dropped
    is_high: float = 2.0  # ... or above
    # MoE router replay (the sampler's routing): off | logprob (old-policy and reference
    # passes) | update (also the update's loss pass); logs router_mismatch.
    router_replay: str = "off"

    def __post_init__(self):
        from posttrain.config import ConfigError

        if self.router_replay not in REPLAY_MODES:
            raise ConfigError(
                f"loss.router_replay={self.router_replay!r}: use one of {REPLAY_MODES}"
            )
        if self.ratio not in RATIO_LEVELS:
            raise ConfigError(f"loss.ratio={self.ratio!r}: use one of {RATIO_LEVELS}")
        if self.aggregation not in AGGREGATIONS:
            raise ConfigError(f"loss.aggregation={self.aggregation!r}: use one of {AGGREGATIONS}")
        if self.kl_estimator not in KL_KINDS:
            raise ConfigError(f"loss.kl_estimator={self.kl_estimator!r}: use one of {KL_KINDS}")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ConfigError("loss.clip_low must be in [0, 1) and loss.clip_high >= 0")
        if self.dual_clip and self.dual_clip <= 1:
            raise ConfigError(f"loss.dual_clip must be 0 (off) or > 1, got {self.dual_clip}")
        if self.correction not in ("off", *CORRECTION_LEVELS):
            raise ConfigError(
                f"loss.correction={self.correction!r}: use off or one of {CORRECTION_LEVELS}"
            )
        if self.correction_mode not in CORRECTION_MODES:
            raise ConfigError(
                f"loss.correction_mode={self.correction_mode!r}: use one of {CORRECTION_MODES}"
            )
        if self.tis_cap and self.correction == "off":
            raise ConfigError(
                "loss.tis_cap is set but loss.correction is 'off': set loss.correction='token' "
                "(token-level truncated importance sampling) or another level"
            )
        if self.correction != "off" and self.correction_mode == "truncate" and self.tis_cap <= 0:
            raise ConfigError("loss.correction_mode='truncate' needs loss.tis_cap > 0 (e.g. 2.0)")
        if not 0 <= self.is_low <= 1 <= self.is_high:
            raise ConfigError(
                f"loss.is_low and loss.is_high must satisfy 0 <= is_low <= 1 <= is_high, got "
                f"{self.is_low}, {self.is_high}"
            )

    def correct(self, old_logps, sampler_logps, mask) -> dict | None:
        """`rollout_correction` of this config (None when off)."""
        if self.correction == "off":
            return None
        return rollout_correction(
            old_logps,
            sampler_logps,
            mask,
            level=self.correction,
            mode=self.correction_mode,
            cap=self.tis_cap or None,
            low=self.is_low,
            high=self.is_high,
        )


def sequence_log_probs(params, model_config: ModelConfig, batch: dict, **kwargs) -> jax.Array:
    """The log-prob `[B, L]` of every target token (old-policy and reference passes);
    `kwargs`: the model's forward arguments (a `posttrain.lora.Policy`'s)."""
    hidden = hidden_states(
        params,
        batch["tokens"],
        model_config,
        batch["positions"],
        batch["segment_ids"],
        images_BIHWC=batch.get("images"),
        **kwargs,
    )
    return token_stats(params, hidden, batch["targets"], model_config)["logp"]


@dataclasses.dataclass(frozen=True)
class CriticLoss:
    """PPO's value term: the critic's config, its loss weight and value clip (0: off)."""

    model_config: ModelConfig
    coef: float = 0.5
    clip: float = 0.2


def rl_loss(
    model_config: ModelConfig,
    config: PolicyLossConfig,
    *,
    max_new_tokens: int,
    use_reference: bool,
    kl_in_loss: bool = True,
    domains: Sequence[str] = (),
    critic: CriticLoss | None = None,
    policy: Policy | None = None,
    fused_old_logps: bool = False,
):
    """`(params, batch, rng) -> sums` of the policy loss (plus KL, entropy and value terms).

    Without a critic, `params` is the policy's and `batch["advantages"]` is `[B]` (one per
    sequence, GRPO family). With one (PPO), `params` is `{"policy", "value"}`, the advantages
    are per token `[B, L]` (GAE) and the batch carries `returns` and `old_values`; the value loss
    is aggregated like the policy loss (same normaliser), times `critic.coef`. `policy` runs
    the trained model from `params` (default: they, or with a critic `params["policy"]`, are
    the model's own).

    Sums: `loss_sum` / `num_tokens` (the aggregation's numerator / normaliser), and token means
    as `X_sum` / `X_count`: `kl`, `entropy`, `clip_fraction`, `ratio`, `approx_kl_old`,
    `logp_gap` (|trainer old log-prob - sampler log-prob|), `kl/<domain>`, `entropy/<domain>`,
    `clip_fraction/<domain>`; with a critic `value_loss`, `value_clip_fraction`, `value`; with
    an off-policy correction `is_dropped` (share of sampled tokens it dropped), `is_weight`
    (mean weight of the kept ones) and `is_ratio` (mean token ratio p_old / p_sampler).

    `fused_old_logps`: the batch has no `old_logps`; with one update per batch they are this
    forward's own log-probs (stop-gradient: the ratio is 1, its gradient the policy gradient's),
    and `logp_gap_max` (the largest |trainer - sampler| gap) is returned here.
    """

    policy = policy or Policy(key="policy" if critic else None)

    def loss_fn(params, batch, rng):
        del rng
        model_params, hidden, aux = policy.forward(
            params, batch, model_config, **replay_kwargs(config.router_replay == "update", batch)
        )
        stats = token_stats(model_params, hidden, batch["targets"], model_config, entropy=True)
        logp = stats["logp"]
        old_logps = jax.lax.stop_gradient(logp) if fused_old_logps else batch["old_logps"]
        mask = batch["loss_mask"]
        if config.mask_truncated:
            mask = mask * (1.0 - batch["truncated"])[:, None]
        sampled = mask
        corrected = config.correct(old_logps, batch["sampler_logps"], mask)
        if corrected is not None:
            mask = corrected["kept"]  # dropped tokens leave the loss and its normaliser
        out = policy_loss(
            logp,
            old_logps,
            batch["advantages"],
            mask,
            clip_low=config.clip_low,
            clip_high=config.clip_high,
            dual_clip=config.dual_clip or None,
            ratio=config.ratio,
            is_weights_BL=None if corrected is None else corrected["weights"],
        )
        per_token = out["losses"]
        entropy = stats["entropy"]
        if config.entropy_coef:
            per_token = per_token - config.entropy_coef * entropy
        else:
            entropy = jax.lax.stop_gradient(entropy)
        sums = {}
        if use_reference:
            kl = kl_estimate(logp, batch["ref_logps"], config.kl_estimator, mask)
            if kl_in_loss:
                per_token = per_token + batch["kl_coefs"][:, None] * kl
            sums.update(_token_mean("kl", jax.lax.stop_gradient(kl), mask))
            for d, name in enumerate(domains):
                in_domain = mask * (batch["domain_ids"] == d)[:, None]
                sums.update(_token_mean(f"kl/{name}", jax.lax.stop_gradient(kl), in_domain))
        if critic is not None:
            from posttrain.rl._critic import token_values

            values = token_values(params["value"], critic.model_config, batch)
            out_v = value_loss(
                values, batch["old_values"], batch["returns"], mask, clip=critic.clip or None
            )
            per_token = per_token + critic.coef * out_v["losses"]
            value_num, _ = aggregate(
                out_v["losses"], mask, config.aggregation, max_len=max_new_tokens
            )
            sums.update(
                {
                    "value_loss_sum": value_num,
                    **_token_mean("value_clip_fraction", out_v["clipped"], mask),
                    **_token_mean("value", jax.lax.stop_gradient(values), mask),
                }
            )
        numerator, normaliser = aggregate(
            per_token, mask, config.aggregation, max_len=max_new_tokens
        )
        gap = jnp.abs(old_logps - batch["sampler_logps"])
        sums = {
            "loss_sum": numerator,
            "num_tokens": normaliser,
            **sums,
            **_token_mean("entropy", entropy, mask),
            **_token_mean("clip_fraction", out["clipped"], mask),
            **_token_mean("ratio", out["ratio"], mask),
            **_token_mean("approx_kl_old", out["approx_kl"], mask),
            **_token_mean("logp_gap", gap, batch["loss_mask"]),
        }
        if fused_old_logps:  # (micro-batches: the step keeps the largest, by the "_max" name)
            sums["logp_gap_max"] = jnp.max(jnp.where(batch["loss_mask"] > 0, gap, 0.0))
        for d, name in enumerate(domains):  # per-domain curves (docs/rl.md "Stability")
            in_domain = mask * (batch["domain_ids"] == d)[:, None]
            sums.update(_token_mean(f"entropy/{name}", entropy, in_domain))
            sums.update(_token_mean(f"clip_fraction/{name}", out["clipped"], in_domain))
        if corrected is not None:
            sums.update(
                {
                    **_token_mean("is_dropped", sampled - corrected["kept"], sampled),
                    **_token_mean("is_weight", corrected["weights"], corrected["kept"]),
                    **_token_mean("is_ratio", corrected["token_ratio"], sampled),
                }
            )
        if "routed_experts" in batch:  # the trainer's own top-k vs the sampler's
            mismatch = router_mismatch(aux["routed_experts"], batch["routed_experts"])
            sums.update(_token_mean("router_mismatch", *mismatch))
        return add_moe_aux(sums, aux)

    return loss_fn


def _token_mean(name: str, values_BL: jax.Array, mask_BL: jax.Array) -> dict[str, jax.Array]:
    """`{name}_sum` / `{name}_count` over the masked tokens (`train_step` divides them)."""
    return {
        f"{name}_sum": jnp.sum(jnp.where(mask_BL > 0, values_BL, 0.0)),
        f"{name}_count": jnp.sum(mask_BL),
    }
