"""Speculative decoding's parts: the drafters and the acceptance rule (the engine runs the
rounds: `_rounds.speculate`; `generate_speculative` is in `_continuous`).

Each round the model runs a row's last emitted token and k drafts as one forward and accepts a
prefix of the drafts by the speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023):
with p the model's sampling distribution (after temperature, top-k and top-p) and q the
drafter's, draft d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first
rejection the row draws from normalize(max(0, p_i - q_i)) instead, and when all k pass it draws
a bonus token from p_{k+1}. Every emitted token is then distributed exactly as plain sampling
would draw it. At temperature 0, p and q are point masses on their argmaxes: drafts are accepted
while they equal the model's argmax, so greedy output is token-identical to plain decoding (up
to float rounding between forwards of different lengths).

Drafters:
- `PromptLookup` (prompt-lookup / n-gram decoding): the k tokens that followed the latest
  earlier occurrence of the row's last `ngram` tokens (shorter n-grams as fallback) in its
  prompt and output so far, continued periodically past the end; q is a point mass on each
  draft, so a draft is accepted with probability p(d) and a rejection draws from p without d.
- `DraftModel`: a smaller `Transformer` with the same vocabulary samples k tokens one at a time
  from its own KV cache.
- `MTP`: the model's own multi-token-prediction module (DeepSeek-V3; `models.mtp_from_hf`)
  samples k tokens one at a time from the model's last hidden state, chaining its own outputs
  after the first; its one-layer KV cache is refreshed with the model's hidden states of the
  accepted tokens after each round.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from posttrain.models import MTPModule, Transformer
from posttrain.sampling._sample import filter_logits


class _Sampling(NamedTuple):
    """The sampling settings (traced scalars) as probabilities and draws."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array

    def probs(self, logits_XV):
        """The sampling distribution over the last axis; a point mass on the argmax when greedy."""

        def sample():
            kwargs = dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
            return jax.nn.softmax(filter_logits(logits_XV, **kwargs), axis=-1)

        def greedy():
            return jax.nn.one_hot(jnp.argmax(logits_XV, axis=-1), logits_XV.shape[-1])

        return jax.lax.cond(self.temperature > 0, sample, greedy)

    def draw(self, key, probs_BV):
        """A token `[B]` from each row of `probs_BV` (its argmax when greedy)."""

        def sample():
            return jax.random.categorical(key, jnp.log(probs_BV), axis=-1).astype(jnp.int32)

        def greedy():
            return jnp.argmax(probs_BV, axis=-1).astype(jnp.int32)

        return jax.lax.cond(self.temperature > 0, sample, greedy)


def _accept(key, p_BLV, drafts_BK, q_BKV, sampling: _Sampling):
    """The speculative-sampling rule on drafts `[B, k]` drawn from q `[B, k, V]`, given the
    model's sampling distributions p `[B, k+1, V]`: (drafts accepted `[B]`, the token drawn
    after them `[B]`: from max(0, p - q) after a rejection, from p after k acceptances)."""
    B, K = drafts_BK.shape
    p_BK = jnp.take_along_axis(p_BLV[:, :K], drafts_BK[..., None], axis=-1)[..., 0]
    q_BK = jnp.take_along_axis(q_BKV, drafts_BK[..., None], axis=-1)[..., 0]
    key_accept, key_draw = jax.random.split(key)
    u_BK = jax.random.uniform(key_accept, (B, K))
    accepted_B = jnp.sum(jnp.cumprod(u_BK * q_BK < p_BK, axis=1), axis=1, dtype=jnp.int32)
    at_B11 = accepted_B[:, None, None]
    p_BV = jnp.take_along_axis(p_BLV, at_B11, axis=1)[:, 0]
    q_BV = jnp.take_along_axis(jnp.pad(q_BKV, ((0, 0), (0, 1), (0, 0))), at_B11, axis=1)[:, 0]
    residual_BV = jnp.maximum(p_BV - q_BV, 0.0)
    # A rejection implies p > q somewhere; the fallback only guards float round-off.
    residual_BV = jnp.where(residual_BV.sum(-1, keepdims=True) > 0, residual_BV, p_BV)
    return accepted_B, sampling.draw(key_draw, residual_BV)


def _lookup(history_BT, length_B, *, ngram: int, k: int):
    """Prompt-lookup drafts `[B, k]`: what followed the latest earlier occurrence of the last
    `ngram` (else fewer) tokens of `history_BT[:, :length_B]`, repeated with the period that
    occurrence implies; the last token repeated where nothing matches."""
    B, T = history_BT.shape
    j_1T = jnp.arange(T)[None]
    start_B = jnp.full((B,), -1, jnp.int32)
    size_B = jnp.zeros((B,), jnp.int32)
    for g in range(1, ngram + 1):  # a longer match overrides a shorter one
        tail_Bg = jnp.take_along_axis(
            history_BT, jnp.maximum(length_B[:, None] - g + jnp.arange(g), 0), axis=1
        )
        padded_BT = jnp.pad(history_BT, ((0, 0), (0, g)), constant_values=-2)
        match_BT = j_1T < (length_B - g)[:, None]  # an earlier occurrence, with a follower
        for i in range(g):
            match_BT &= padded_BT[:, i : i + T] == tail_Bg[:, i : i + 1]
        found_B = jnp.any(match_BT, axis=1) & (length_B >= g)
        start_B = jnp.where(found_B, jnp.max(jnp.where(match_BT, j_1T, -1), axis=1), start_B)
        size_B = jnp.where(found_B, g, size_B)
    period_B = jnp.maximum(length_B - size_B - start_B, 1)
    index_BK = start_B[:, None] + size_B[:, None] + jnp.arange(k) % period_B[:, None]
    index_BK = jnp.where(start_B[:, None] >= 0, index_BK, length_B[:, None] - 1)
    return jnp.take_along_axis(history_BT, index_BK, axis=1)


@functools.partial(jax.tree_util.register_dataclass, data_fields=[], meta_fields=["ngram", "k"])
@dataclasses.dataclass(frozen=True)
class PromptLookup:
    """Prompt-lookup (n-gram) drafting, no draft model: proposes the k tokens that followed the
    latest earlier occurrence of the last `ngram` tokens (falling back to shorter n-grams) in
    the prompt and the tokens generated so far. Pays off on text that repeats its context
    (code edits, extraction, quoting, loops).

    Attributes:
      ngram: longest suffix looked up.
      k: tokens proposed per round.
    """

    ngram: int = 3
    k: int = 4

    def __post_init__(self):
        if self.ngram < 1 or self.k < 1:
            raise ValueError(f"PromptLookup needs ngram >= 1 and k >= 1, got {self}")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["model"], meta_fields=["k"])
@dataclasses.dataclass(frozen=True)
class DraftModel:
    """A smaller model with the same vocabulary (e.g. a 0.5B checkpoint of a 7B's family, with
    the same tokenizer) that samples k tokens per round from its own KV cache.

    Attributes:
      model: the draft `Transformer` (its params are a jit argument: new weights, no recompile).
      k: tokens proposed per round.
    """

    model: Transformer
    k: int = 4

    def __post_init__(self):
        if self.k < 1:
            raise ValueError(f"DraftModel needs k >= 1, got k={self.k}")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["module"], meta_fields=["k"])
@dataclasses.dataclass(frozen=True)
class MTP:
    """Drafting with the model's multi-token-prediction module (DeepSeek-V3 and its kind ship
    one: `posttrain.models.mtp_from_hf`): no second model, drafts conditioned on the model's
    own hidden state. The module was trained for the token after the next one (one draft);
    k > 1 chains it on its own outputs, past what it was trained for.

    Attributes:
      module: the `MTPModule` (its params are a jit argument: new weights, no recompile).
      k: tokens proposed per round.
    """

    module: MTPModule
    k: int = 1

    def __post_init__(self):
        if self.k < 1:
            raise ValueError(f"MTP needs k >= 1, got k={self.k}")


def drafter_for(speculative: int, mtp: MTPModule | None = None) -> PromptLookup | MTP | None:
    """The drafter of `speculative` tokens a round: the model's MTP module when given, else
    prompt lookup; None for plain decoding (0)."""
    if not speculative:
        return None
    return PromptLookup(k=speculative) if mtp is None else MTP(mtp, k=speculative)


def check_drafter(drafter, model: Transformer) -> None:
    """A clear error for what is not a drafter of `model`."""
    if not isinstance(drafter, PromptLookup | DraftModel | MTP):
        raise ValueError(f"drafter must be a PromptLookup, a DraftModel or an MTP, got {drafter!r}")
    if isinstance(drafter, MTP):
        ours, theirs = drafter.module.config, model.config
        fields = ("embed_dim", "vocab_size", "num_heads", "mla", "moe")
        if any(getattr(ours, f) != getattr(theirs, f) for f in fields):
            raise ValueError(
                f"the MTP module was built for another model (its {fields} differ from the "
                f"model's); load it from the model's own checkpoint with mtp_from_hf"
            )
    if isinstance(drafter, DraftModel) and (
        drafter.model.config.vocab_size != model.config.vocab_size
    ):
        raise ValueError(
            f"the draft model's vocab_size ({drafter.model.config.vocab_size}) differs from the "
            f"model's ({model.config.vocab_size}); a draft model must share the tokenizer"
        )


def draft_config(drafter):
    """The config of the drafter's KV pool (None: it has none)."""
    if isinstance(drafter, DraftModel):
        return drafter.model.config
    return drafter.module.block_config if isinstance(drafter, MTP) else None


def drafter_lookahead(drafter, model: Transformer, kv_dtype: str) -> int:
    """Positions a round writes past a row's length (k; 0 without a drafter), or a clear error
    for a drafter the engine cannot use (with a KV cache of `kv_dtype`)."""
    if drafter is None:
        return 0
    check_drafter(drafter, model)
    if kv_dtype == "int8_layered":
        raise ValueError(
            "speculative decoding does not work with kv_dtype='int8_layered' (a round's drafts "
            "would overwrite the ring of recent tokens); use 'int8' or 'auto'"
        )
    return drafter.k
