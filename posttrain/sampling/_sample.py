"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASKED = -jnp.inf


def filter_logits(logits_BV, *, temperature, top_k, top_p):
    """The sampling distribution's logits: scaled by 1/temperature, then the top-k tokens kept,
    then the smallest set whose probability reaches top_p (HF's order). Removed tokens get
    -inf. `top_k=0` and `top_p=1` keep everything; all three may be traced scalars."""
    V = logits_BV.shape[-1]
    scaled_BV = logits_BV.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
    sorted_BV = jnp.flip(jnp.sort(scaled_BV, axis=-1), axis=-1)  # descending
    rank_V = jnp.arange(V)
    keep_BV = rank_V < jnp.where(top_k > 0, top_k, V)
    sorted_BV = jnp.where(keep_BV, sorted_BV, _MASKED)
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV  # mass of the higher-ranked tokens
    keep_BV &= (before_BV < top_p) | (rank_V == 0)
    # The smallest kept logit is the cut: ties with it are kept too, as in HF.
    cut_B1 = jnp.min(jnp.where(keep_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled_BV >= cut_B1, scaled_BV, _MASKED)


def unfiltered(top_k, top_p):
    """Whether top-k and top-p keep every token (then sampling needs no vocabulary sort)."""
    return (top_k <= 0) & (top_p >= 1.0)


def draw_unfiltered(rng, logits_BV, temperature):
    """A draw from softmax(logits / temperature) over the whole vocabulary: what
    `filter_logits` keeps with top_k=0, top_p=1 (without its float32 cumulative sum's rounding,
    which can drop a tail token whose mass is below 1e-7)."""
    scaled_BV = logits_BV.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
    return jax.random.categorical(rng, scaled_BV, axis=-1).astype(jnp.int32)


def sample_tokens(rng, logits_BV, *, temperature, top_k, top_p):
    """Next token ids `[B]`: argmax where temperature is 0, else a draw from `filter_logits`.

    Real branches on the (scalar) settings: greedy decoding, and sampling without top-k or
    top-p (RL rollouts), skip the vocabulary sort that top-k/top-p need, which is most of a
    small model's decode step.
    """

    def greedy():
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)

    def plain():
        return draw_unfiltered(rng, logits_BV, temperature)

    def sample():
        filtered_BV = filter_logits(logits_BV, temperature=temperature, top_k=top_k, top_p=top_p)
        return jax.random.categorical(rng, filtered_BV, axis=-1).astype(jnp.int32)

    branch = jnp.where(temperature > 0, jnp.where(unfiltered(top_k, top_p), 1, 2), 0)
    return jax.lax.switch(branch, (greedy, plain, sample))
