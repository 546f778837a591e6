"""The losses the shared train step takes over a model's forward pass: SFT's cross-entropy and
the DPO family's pairwise loss (with the reference log-probs it compares against). Methods build
their steps from them; eval scores held-out data with the same functions.

The DPO family. The batch is `preference_batches`' (chosen_* and rejected_* `[B, L]`
arrays). Chosen and rejected run through the policy in one forward pass (stacked along the
batch, `[2B, L]`), are scored with `token_log_probs` + `sequence_logps` (summed over response
tokens) and compared by `preference_loss`. The normaliser `num_tokens` is the number of real
pairs (rows whose chosen and rejected both have response tokens), so padding rows and
micro-batches add up exactly.

Reference log-probs come from one of:
  - "precomputed": `batch["ref_chosen_logps"]`, `batch["ref_rejected_logps"]` (`[B]`), filled
    once per dataset by `reference_logps` (TRL's `precompute_ref_log_probs`): no reference
    weights in memory during training.
  - "on_the_fly": `ref_params`, closed over by the loss. The reference is a separate params
    pytree (never an edit to the policy), under `stop_gradient`. Build the loss INSIDE the
    jitted step so that `ref_params` is a traced argument with its own sharding, not a constant
    baked into the executable:

        def step(state, ref_params, batch):
            loss_fn = dpo_loss(model_config, reference="on_the_fly", ref_params=ref_params)
            return train_step(state, batch, loss_fn=loss_fn, optimizer=optimizer)

        step = jax.jit(step, in_shardings=(state_sh, param_sh, batch_sh), donate_argnums=0)

    (The batch cannot carry the reference: `train_step` splits every batch leaf into
    micro-batches along its first axis.) The reference must not share buffers with the policy
    it starts from (`jax.tree.map(jnp.copy, params)`): the step donates the policy's.
  - "none": reference-free variants (simpo, orpo).
A `posttrain.lora.Policy` runs the trained model: with LoRA, `params` are adapters on a frozen
base and the on-the-fly reference is that base with the adapters off (no second copy of the
weights); the loss does not know which.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from posttrain.lora import Policy
from posttrain.losses import (
    LENGTH_NORMALISED,
    LOSS_TYPES,
    REFERENCE_FREE,
    cross_entropy_from_stats,
    preference_loss,
    sequence_logps,
    token_stats,
)
from posttrain.models import ModelConfig, hidden_states, loss_row_groups
from posttrain.train._step import add_moe_aux


def sft_loss(model_config: ModelConfig, z_loss: float, *, policy: Policy | None = None):
    """`(params, batch, rng) -> sums` for the shared train step; `policy` runs the trained
    model from `params` (default: they are the model's own)."""
    policy = policy or Policy()

    def tail(params, hidden, rows):
        stats = token_stats(params, hidden, rows["targets"], model_config)
        return cross_entropy_from_stats(stats, rows["loss_mask"], z_loss)

    def loss_fn(params, batch, rng):
        del rng
        rows = {"targets": batch["targets"], "loss_mask": batch["loss_mask"]}
        tokens = jnp.sum(batch["loss_mask"].astype(jnp.float32))  # (`add_moe_aux`'s weight)
        sums, aux = policy.sums(params, batch, model_config, tail, rows, aux_weight=tokens)
        return add_moe_aux(sums, aux)

    return loss_fn


REFERENCES = ("on_the_fly", "precomputed", "none")


def stacked_pairs(batch: dict) -> dict:
    """chosen_* and rejected_* `[B, L]` -> `[2B, L]` (chosen rows first); a VLM's pair images
    `[B, I, H, W, C]` serve both sides."""
    names = ("tokens", "targets", "loss_mask", "positions", "segment_ids")
    out = {n: jnp.concatenate([batch[f"chosen_{n}"], batch[f"rejected_{n}"]]) for n in names}
    if "images" in batch:
        out["images"] = jnp.concatenate([batch["images"], batch["images"]])
    return out


def _pair_lengths(loss_mask_2B):
    """`((chosen lengths, rejected lengths), real pairs)` `[B]` of stacked pairs' masks: a
    real pair has response tokens on both sides."""
    len_c_B, len_r_B = jnp.split(jnp.sum(loss_mask_2B.astype(jnp.float32), -1), 2)
    return (len_c_B, len_r_B), (len_c_B > 0) & (len_r_B > 0)


def domain_accuracy_sums(accuracies_B, valid_B, domain_ids_B, domains: Sequence[str]) -> dict:
    """`accuracy/<name>_sum` and `accuracy/<name>_count` per domain (see `train_step`)."""
    sums = {}
    for d, name in enumerate(domains):
        in_domain_B = valid_B & (domain_ids_B == d)
        sums[f"accuracy/{name}_sum"] = jnp.sum(jnp.where(in_domain_B, accuracies_B, 0.0))
        sums[f"accuracy/{name}_count"] = jnp.sum(in_domain_B.astype(jnp.float32))
    return sums


def reference_logps(
    ref_params: dict, model_config: ModelConfig, batch: dict, **forward_kwargs
) -> dict:
    """The reference model's summed response log-probs, to store in the batch ("precomputed").

    Args:
      ref_params: the reference model's params (usually the SFT checkpoint the policy starts
        from), with `forward_kwargs` (a `Policy`'s `reference()` gives both: a LoRA run's
        frozen base with the adapters off).
      model_config: its config.
      batch: a preference batch.

    Returns:
      {"ref_chosen_logps": `[B]`, "ref_rejected_logps": `[B]`} (float32, gradients stopped);
      jittable.
    """
    ref_params = jax.lax.stop_gradient(ref_params)
    x = stacked_pairs(batch)
    hidden_2BLD = hidden_states(
        ref_params,
        x["tokens"],
        model_config,
        x["positions"],
        x["segment_ids"],
        images_BIHWC=x.get("images"),
        **forward_kwargs,
    )
    token_logps = token_stats(ref_params, hidden_2BLD, x["targets"], model_config)["logp"]
    logps_2B = sequence_logps(token_logps, x["loss_mask"])
    chosen_B, rejected_B = jnp.split(jax.lax.stop_gradient(logps_2B), 2)
    return {"ref_chosen_logps": chosen_B, "ref_rejected_logps": rejected_B}


def dpo_loss(
    model_config: ModelConfig,
    *,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    gamma: float = 0.0,
    reference: str = "on_the_fly",
    ref_params: dict | None = None,
    sft_weight: float = 0.0,
    domains: Sequence[str] = (),
    policy: Policy | None = None,
):
    """`(params, batch, rng) -> sums` of a pairwise preference loss, for `train_step`.

    Args:
      model_config: the policy's (and reference's) model config.
      loss_type: one of `posttrain.losses._preference.LOSS_TYPES` (sigmoid = DPO).
      beta, label_smoothing, gamma: as in `preference_loss`.
      reference: "on_the_fly" (reference forward pass on `ref_params` each step),
        "precomputed" (`batch["ref_chosen_logps"]`, `batch["ref_rejected_logps"]`), or "none"
        (reference-free loss types only). See the module docstring.
      ref_params: the reference params, for "on_the_fly" when the policy has no frozen model
        of its own (a LoRA policy's base with the adapters off is its reference).
      sft_weight: adds `sft_weight` x the chosen response's per-token NLL to each pair's loss
        (RPO, TRL's `rpo_alpha`; TRL averages the NLL over the batch's tokens, we over each
        pair's). Not for orpo, whose loss already holds that term.
      domains: domain names (the data's `domain_ids` index them); each adds
        `accuracy/<name>_sum` and `accuracy/<name>_count`, which `train_step` turns into that
        domain's accuracy.
      policy: runs the trained model from `params` (default: they are the model's own).

    Returns:
      The loss function. Its sums: `loss_sum` (per-pair losses; for orpo each pair's chosen
      per-token NLL plus the odds-ratio term, as TRL's ORPO), `num_tokens` (real pairs),
      `rewards/chosen_sum`, `rewards/rejected_sum`, `rewards/margins_sum`, `accuracy_sum`,
      `logps/chosen_sum`, `logps/rejected_sum` (TRL's metric names); `train_step` divides each
      `*_sum` by the number of pairs.

    Raises:
      ValueError: an unknown loss_type or reference, a reference that does not fit the loss
        type, or ref_params missing for (or given without) "on_the_fly".
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}: use one of {LOSS_TYPES}")
    if reference not in REFERENCES:
        raise ValueError(f"reference={reference!r}: use one of {REFERENCES}")
    if (reference == "none") != (loss_type in REFERENCE_FREE):
        raise ValueError(
            f"loss_type={loss_type!r} needs reference="
            f"{'none' if loss_type in REFERENCE_FREE else 'on_the_fly or precomputed'}, "
            f"got {reference!r}"
        )
    policy = policy or Policy()
    if (reference == "on_the_fly" and policy.frozen() is None) != (ref_params is not None):
        raise ValueError(
            "pass ref_params exactly when reference='on_the_fly' and the policy has no frozen "
            "model (a LoRA policy's reference is its base with the adapters off)"
        )
    if sft_weight < 0 or (sft_weight and loss_type == "orpo"):
        raise ValueError(
            f"sft_weight={sft_weight}: use a weight >= 0, and 0 with orpo (its loss has the term)"
        )
    normalised = loss_type in LENGTH_NORMALISED
    domains = tuple(domains)

    def tail(params, hidden, rows):
        """The sums of a group of pairs: its rows are chosen sides, then their rejected ones."""
        token_logps = token_stats(params, hidden, rows["targets"], model_config)["logp"]
        chosen_B, rejected_B = jnp.split(sequence_logps(token_logps, rows["loss_mask"]), 2)
        (len_c_B, len_r_B), valid_B = _pair_lengths(rows["loss_mask"])
        # A filler row scores log p = 0, where ORPO's log(1 - p) is -inf; give it a finite
        # stand-in so no NaN reaches the gradient (its loss is left out of the sums below).
        chosen_B = jnp.where(valid_B, chosen_B, -1.0)
        rejected_B = jnp.where(valid_B, rejected_B, -1.0)
        refs = {}
        if reference != "none":
            ref_c_B, ref_r_B = jnp.split(rows["ref_logps"], 2)
            refs = {"ref_chosen_logps_B": ref_c_B, "ref_rejected_logps_B": ref_r_B}
        lengths = {"chosen_lengths_B": len_c_B, "rejected_lengths_B": len_r_B} if normalised else {}
        out = preference_loss(
            chosen_B,
            rejected_B,
            **refs,
            loss_type=loss_type,
            beta=beta,
            label_smoothing=label_smoothing,
            gamma=gamma,
            **lengths,
        )
        losses_B = out["losses"]
        chosen_nll_B = -chosen_B / jnp.maximum(len_c_B, 1.0)
        if loss_type == "orpo":
            losses_B = losses_B + chosen_nll_B
        elif sft_weight:
            losses_B = losses_B + sft_weight * chosen_nll_B
        # Filler rows (no response tokens) are not pairs: their losses stay out of the sums.
        total = lambda x: jnp.sum(jnp.where(valid_B, x, 0.0))
        accuracies_B = out["rewards/accuracies"]
        domain_ids_B = jnp.split(rows["domain_ids"], 2)[0]
        return {
            **domain_accuracy_sums(accuracies_B, valid_B, domain_ids_B, domains),
            "loss_sum": total(losses_B),
            "num_tokens": jnp.sum(valid_B.astype(jnp.float32)),
            "rewards/chosen_sum": total(out["rewards/chosen"]),
            "rewards/rejected_sum": total(out["rewards/rejected"]),
            "rewards/margins_sum": total(out["rewards/margins"]),
            "accuracy_sum": total(out["rewards/accuracies"]),
            "logps/chosen_sum": total(out["logps/chosen"]),
            "logps/rejected_sum": total(out["logps/rejected"]),
        }

    def loss_fn(params, batch, rng):
        del rng
        pairs = batch["chosen_tokens"].shape[0]
        if pairs % (groups := loss_row_groups(model_config)):
            raise ValueError(
                f"{pairs} pairs do not split into the 1F1B pipeline's {groups} microbatches "
                "(a pair's two rows run in one); set model.pipeline_microbatches to a divisor "
                "of the pairs per micro-batch"
            )
        x = stacked_pairs(batch)
        rows = {n: x[n] for n in ("targets", "loss_mask")}
        rows["domain_ids"] = jnp.concatenate([batch["domain_ids"], batch["domain_ids"]])
        if reference == "precomputed":
            refs = (batch["ref_chosen_logps"], batch["ref_rejected_logps"])
        elif reference == "on_the_fly":
            ref_model, ref_kwargs = policy.reference(ref_params)
            ref = reference_logps(ref_model, model_config, batch, **ref_kwargs)
            refs = (ref["ref_chosen_logps"], ref["ref_rejected_logps"])
        if reference != "none":
            rows["ref_logps"] = jax.lax.stop_gradient(jnp.concatenate(refs))
        pairs = jnp.sum(_pair_lengths(x["loss_mask"])[1].astype(jnp.float32))  # (`add_moe_aux`'s)
        sums, aux = policy.sums(params, x, model_config, tail, rows, aux_weight=pairs)
        return add_moe_aux(sums, aux)

    return loss_fn
