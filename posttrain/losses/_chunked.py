"""What every loss needs from the vocabulary distribution, per token, without `[B, L, V]` logits.

`token_stats` reads the final hidden states and computes the logits of `logits_chunk`
positions of each row at a time inside a `lax.map` whose body is rematerialised: the backward
pass recomputes one chunk's logits, takes their gradient into the hidden states and lm_head,
and drops them, so at most a chunk's `[B, c, V]` logits (and their gradient) exist at once. At
128k tokens and a 152k vocabulary the full float32 logits are ~80 GB per sequence; 2048-position
chunks are 1.2 GB.

Chunk i holds positions `i, i + n, i + 2n, ...` (n chunks): each chunk spans the whole row,
so a row sharded over the `sequence` axis keeps every device busy on every chunk.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from posttrain.losses._rl import entropy_from_logits
from posttrain.models import ModelConfig, lm_logits, token_logprobs


def logit_stats(logits_BLV: jax.Array, targets_BL: jax.Array, *, entropy: bool = False) -> dict:
    """Per position, float32 `[B, L]`: `logp` (log p(target)), `log_z` (the softmax's log
    normaliser), `correct` (1 where the argmax is the target) and, with `entropy`, `entropy`."""
    logits = logits_BLV.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, targets_BL[..., None], axis=-1)[..., 0]
    out = {
        "logp": target - log_z,
        "log_z": log_z,
        "correct": (jnp.argmax(logits, axis=-1) == targets_BL).astype(jnp.float32),
    }
    if entropy:
        out["entropy"] = entropy_from_logits(logits)
    return out


def token_stats(
    params: dict,
    hidden_BLD: jax.Array,
    targets_BL: jax.Array,
    config: ModelConfig,
    *,
    entropy: bool = False,
) -> dict:
    """`logit_stats` of the model's logits over `hidden_BLD` (final hidden states), computed
    `config.logits_chunk` positions of each row at a time (0, or a chunk >= L: all at once).
    Equal to `logit_stats(lm_logits(params, hidden_BLD, config), ...)` up to float rounding,
    values and gradients."""
    B, L, D = hidden_BLD.shape
    c = config.logits_chunk
    if config.batch_invariant:  # log-probs with the sampler's bits (`token_logprobs`)
        logits = lm_logits(params, hidden_BLD, config)
        stats = logit_stats(logits, targets_BL, entropy=entropy)
        return {**stats, "logp": token_logprobs(logits, targets_BL)}
    if not c or c >= L:
        return logit_stats(lm_logits(params, hidden_BLD, config), targets_BL, entropy=entropy)
    n = -(-L // c)
    if n * c > L:  # pad to whole chunks; the padded positions are cut off below
        hidden_BLD = jnp.pad(hidden_BLD, ((0, 0), (0, n * c - L), (0, 0)))
        targets_BL = jnp.pad(targets_BL, ((0, 0), (0, n * c - L)))
    # Position j * n + i -> [chunk i, row, j].
    h_nBcD = hidden_BLD.reshape(B, c, n, D).transpose(2, 0, 1, 3)
    t_nBc = targets_BL.reshape(B, c, n).transpose(2, 0, 1)

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def chunk(xs):
        h_BcD, t_Bc = xs
        return logit_stats(lm_logits(params, h_BcD, config), t_Bc, entropy=entropy)

    stats = jax.lax.map(chunk, (h_nBcD, t_nBc))
    return {k: v.transpose(1, 2, 0).reshape(B, n * c)[:, :L] for k, v in stats.items()}


def cross_entropy_from_stats(
    stats: dict, mask_BL: jax.Array, z_loss: float = 0.0
) -> dict[str, jax.Array]:
    """`cross_entropy_sums` from `logit_stats` / `token_stats`."""
    mask = mask_BL.astype(jnp.float32)
    nll_sum = -jnp.sum(stats["logp"] * mask)
    z_sum = jnp.sum(jnp.square(stats["log_z"]) * mask)
    return {
        "loss_sum": nll_sum + z_loss * z_sum,
        "nll_sum": nll_sum,
        "z_loss_sum": z_sum,
        "accuracy_sum": jnp.sum(stats["correct"] * mask),
        "num_tokens": jnp.sum(mask),
    }
