"""Speculative decoding: a cheap drafter proposes k tokens, the model checks them in one forward.

Each round the target model runs the row's last emitted token and the k drafts as one L = k+1
forward over its `KVCache`, and accepts a prefix of the drafts by the speculative-sampling rule
(Leviathan et al. 2023, Chen et al. 2023): with p the model's sampling distribution (after
temperature, top-k and top-p) and q the drafter's, draft d_i is accepted with probability
min(1, p_i(d_i) / q_i(d_i)); at the first rejection the row draws from normalize(max(0, p_i -
q_i)) instead, and when all k pass it draws a bonus token from p_{k+1}. Every emitted token is
then distributed exactly as plain sampling would draw it. At temperature 0, p and q are point
masses on their argmaxes: drafts are accepted while they equal the model's argmax, so greedy
output is token-identical to `generate`'s (up to float rounding between forwards of different
lengths). A round emits 1 to k+1 tokens per row for one forward of the model. The prefill
covers all but each prompt's last token, which the first round feeds ahead of its drafts.

Drafters:
- `PromptLookup` (prompt-lookup / n-gram decoding): the k tokens that followed the latest
  earlier occurrence of the row's last `ngram` tokens (shorter n-grams as fallback) in its
  prompt and output so far, continued periodically past the end; q is a point mass on each
  draft, so a draft is accepted with probability p(d) and a rejection draws from p without d.
- `DraftModel`: a smaller `Transformer` with the same vocabulary samples k tokens one at a time
  from its own KV cache.
MTP heads (DeepSeek-V3 / Kimi-K2 multi-token prediction) are not a drafter here yet.

The cache. `KVCache` has one write index for all rows, and rows accept different numbers of
drafts. Every round writes k+1 slots for every row at the shared index; afterwards the slots of
each row's rejected drafts get segment id -1, so nothing attends them again (attention masks by
position and segment id, never by slot order), and each row keeps its own next position. Rather
than sizing the cache for the worst case (P + max_new_tokens * (k+1) slots), it holds
P + max_new_tokens + 2(k+1): when the next round would not fit, each row's live slots are
gathered to the front (order kept), the rejected ones and finished rows dropped, and the index
set to the longest row. A row's live slots never exceed P + max_new_tokens, so the round fits.
The draft model's cache follows the same scheme: each round it runs k+1 one-token steps on
[last token, d_1 .. d_k] (the last step only to cache d_k, which is context if accepted), so it
holds the same tokens in the same slots as the model's cache and shares its live-slot mask.

The whole loop over rounds is one jitted `lax.while_loop` (the host syncs once, at the end);
the weights of the model and of a draft model are jit arguments, as in `generate`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.models import KVCache, Transformer, hidden_states
from posttrain.sampling._generate import Completion, _check, _finish, _keys, _prepare
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


class _Round(NamedTuple):
    """What a drafter sees at the start of a round, per row."""

    last_B: jax.Array  # the last emitted token, in no cache yet
    position_B: jax.Array  # its position
    history_BT: jax.Array  # the left-padded prompt (padding -1), then the tokens emitted
    length_B: jax.Array  # how much of history_BT is filled
    sampling: _Sampling
    vocab: int


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


def _prefill(model: Transformer, tokens_BP, positions_BP, segment_ids_BP, slots: int, n: int):
    """A cache of `slots` slots holding the left-padded `tokens_BP`, each row repeated n times."""
    cache = KVCache.init(model.config, tokens_BP.shape[0], slots)
    if tokens_BP.shape[1]:
        _, cache = hidden_states(
            model.params, tokens_BP, model.config, positions_BP, segment_ids_BP, cache
        )
    return KVCache(
        k_TBSKH=jnp.repeat(cache.k_TBSKH, n, axis=1),
        v_TBSKH=jnp.repeat(cache.v_TBSKH, n, axis=1),
        positions_BS=jnp.repeat(cache.positions_BS, n, axis=0),
        segment_ids_BS=jnp.repeat(cache.segment_ids_BS, n, axis=0),
        index=cache.index,
    )


def _mark(cache: KVCache, start, live_BL) -> KVCache:
    """Segment id -1 (never attended) for the slots from `start` where `live_BL` is False."""
    segment_ids_BS = jax.lax.dynamic_update_slice_in_dim(
        cache.segment_ids_BS, jnp.where(live_BL, 1, -1).astype(jnp.int32), start, axis=1
    )
    return dataclasses.replace(cache, segment_ids_BS=segment_ids_BS)


def _compact(cache: KVCache, active_B) -> KVCache:
    """Each active row's live slots moved to the front in order; the rest dropped."""
    S = cache.segment_ids_BS.shape[1]
    live_BS = (cache.segment_ids_BS == 1) & active_B[:, None]
    order_BS = jnp.argsort(~live_BS, axis=1, stable=True)
    count_B = live_BS.sum(axis=1)
    gather = functools.partial(jnp.take_along_axis, indices=order_BS[None, :, :, None, None])
    return KVCache(
        k_TBSKH=gather(cache.k_TBSKH, axis=2),
        v_TBSKH=gather(cache.v_TBSKH, axis=2),
        positions_BS=jnp.take_along_axis(cache.positions_BS, order_BS, axis=1),
        segment_ids_BS=jnp.where(jnp.arange(S)[None] < count_B[:, None], 1, -1).astype(jnp.int32),
        index=jnp.max(count_B).astype(jnp.int32),
    )


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

    def _start(self, tokens_BP, positions_BP, segment_ids_BP, slots: int, n: int):
        return ()

    def _propose(self, state, key, now: _Round):
        drafts_BK = _lookup(now.history_BT, now.length_B, ngram=self.ngram, k=self.k)
        return drafts_BK, jax.nn.one_hot(drafts_BK, now.vocab), state

    def _commit(self, state, live_BL):
        return state

    def _compact(self, state, active_B):
        return state


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

    def _start(self, tokens_BP, positions_BP, segment_ids_BP, slots: int, n: int):
        return _prefill(self.model, tokens_BP, positions_BP, segment_ids_BP, slots, n)

    def _propose(self, cache, key, now: _Round):
        # k+1 one-token steps feed [last, d_1 .. d_k]: the draft cache then holds the same
        # tokens in the same slots as the model's (the last step's own draw is not used).
        def step(carry, xs):
            cache, token_B = carry
            key, i = xs
            logits_B1V, cache = self.model(
                token_B[:, None],
                (now.position_B + i)[:, None],
                jnp.ones_like(token_B[:, None]),
                cache,
            )
            q_BV = now.sampling.probs(logits_B1V[:, 0])
            token_B = now.sampling.draw(key, q_BV)
            return (cache, token_B), (token_B, q_BV)

        xs = (jax.random.split(key, self.k + 1), jnp.arange(self.k + 1))
        (cache, _), (drafts_LB, q_LBV) = jax.lax.scan(step, (cache, now.last_B), xs)
        return drafts_LB[: self.k].T, jnp.swapaxes(q_LBV[: self.k], 0, 1), cache

    def _commit(self, cache, live_BL):
        return _mark(cache, cache.index - (self.k + 1), live_BL)

    def _compact(self, cache, active_B):
        return _compact(cache, active_B)


@functools.partial(jax.jit, static_argnames=("max_new_tokens", "n"))
def _speculate_padded(
    model: Transformer,
    drafter: PromptLookup | DraftModel,
    tokens_BP,
    lengths_B,
    eos_E,
    rng,
    temperature,
    top_k,
    top_p,
    *,
    max_new_tokens: int,
    n: int,
):
    """Prefill all but the last token of left-padded prompts, repeat rows n times, then rounds
    of draft + verify; returns (tokens `[B*n, max_new_tokens]`, logprobs, number generated,
    hit EOS, stats)."""
    config = model.config
    N, K, V = max_new_tokens, drafter.k, config.vocab_size
    B, P = tokens_BP.shape
    pad_B1 = (P - lengths_B)[:, None]
    slot_1P = jnp.arange(P, dtype=jnp.int32)[None]
    real_BP = slot_1P >= pad_B1
    positions_BP = jnp.where(real_BP, slot_1P - pad_B1, 0)
    slots = P + N + 2 * (K + 1)
    prefill = (tokens_BP[:, :-1], positions_BP[:, :-1], real_BP[:, :-1].astype(jnp.int32))
    cache = _prefill(model, *prefill, slots, n)
    draft = drafter._start(*prefill, slots, n)

    last_B = jnp.repeat(tokens_BP[:, -1], n)
    position_B = jnp.repeat(lengths_B - 1, n)
    # Prompt then output, in the padded frame (padding -1 never matches a lookup).
    history_BT = jnp.concatenate(
        [jnp.where(real_BP, tokens_BP, -1), jnp.zeros((B, N + K + 1), jnp.int32)], axis=1
    )
    history_BT = jnp.repeat(history_BT, n, axis=0)
    B *= n
    sampling = _Sampling(temperature, top_k, top_p)
    j_1L = jnp.arange(K + 1)[None]
    write = jax.vmap(lambda row, new, start: jax.lax.dynamic_update_slice(row, new, (start,)))

    def running(state):
        return ~jnp.all(state["done_B"])

    def fits(state):  # the next round's k+1 slots fit in the cache
        return running(state) & (state["cache"].index + K + 1 <= slots)

    def compact(state):
        active_B = ~state["done_B"]
        cache = _compact(state["cache"], active_B)
        return dict(state, cache=cache, draft=drafter._compact(state["draft"], active_B))

    def rounds_until_full(state):
        state = jax.lax.cond(fits(state), lambda s: s, compact, state)
        return jax.lax.while_loop(fits, body, state)

    def body(state):
        cache, draft = state["cache"], state["draft"]
        done_B, num_B = state["done_B"], state["num_B"]
        active_B = ~done_B
        key_draft, key_accept = jax.random.split(jax.random.fold_in(rng, state["rounds"]))
        now = _Round(
            state["last_B"], state["position_B"], state["history_BT"], P + num_B, sampling, V
        )
        drafts_BK, q_BKV, draft = drafter._propose(draft, key_draft, now)
        start = cache.index
        logits_BLV, cache = model(
            jnp.concatenate([state["last_B"][:, None], drafts_BK], axis=1),
            state["position_B"][:, None] + j_1L,
            jnp.ones((B, K + 1), jnp.int32),
            cache,
        )
        accepted_B, next_B = _accept(
            key_accept, sampling.probs(logits_BLV), drafts_BK, q_BKV, sampling
        )
        emitted_BL = jnp.where(
            j_1L < accepted_B[:, None], jnp.pad(drafts_BK, ((0, 0), (0, 1))), next_B[:, None]
        )
        logprobs_BL = jnp.take_along_axis(
            jax.nn.log_softmax(logits_BLV, axis=-1), emitted_BL[..., None], axis=-1
        )[..., 0]
        eos_BL = jnp.isin(emitted_BL, eos_E) & (j_1L <= accepted_B[:, None])
        first_eos_B = jnp.where(jnp.any(eos_BL, axis=1), jnp.argmax(eos_BL, axis=1), K + 1)
        count_B = jnp.minimum(jnp.minimum(accepted_B, first_eos_B) + 1, N - num_B)
        count_B = jnp.where(active_B, count_B, 0)

        # Slots of [last, d_1 .. d_a] stay; rejected drafts (and finished rows) are never seen.
        live_BL = (j_1L <= accepted_B[:, None]) & active_B[:, None]
        return dict(
            rounds=state["rounds"] + 1,
            cache=_mark(cache, start, live_BL),
            draft=drafter._commit(draft, live_BL),
            last_B=next_B,
            position_B=state["position_B"] + accepted_B + 1,
            history_BT=write(state["history_BT"], emitted_BL, P + num_B),
            logprobs_BN=write(state["logprobs_BN"], logprobs_BL, num_B),
            num_B=num_B + count_B,
            done_B=done_B | (first_eos_B < count_B) | (num_B + count_B >= N),
            hit_eos_B=state["hit_eos_B"] | (first_eos_B < count_B),
            proposed=state["proposed"] + K * jnp.sum(active_B),
            accepted=state["accepted"] + jnp.sum(jnp.where(active_B, accepted_B, 0)),
        )

    zero = jnp.zeros((), jnp.int32)
    state = dict(
        rounds=zero,
        cache=cache,
        draft=draft,
        last_B=last_B,
        position_B=position_B,
        history_BT=history_BT,
        logprobs_BN=jnp.zeros((B, N + K + 1), jnp.float32),
        num_B=jnp.zeros((B,), jnp.int32),
        done_B=jnp.zeros((B,), bool),
        hit_eos_B=jnp.zeros((B,), bool),
        proposed=zero,
        accepted=zero,
    )
    # Compacting is a branch of the outer loop, not of every round: the rounds' loop never
    # passes the cache through a conditional (which may copy it).
    state = jax.lax.while_loop(running, rounds_until_full, state)
    stats = {name: state[name] for name in ("rounds", "proposed", "accepted")}
    tokens_BN = state["history_BT"][:, P : P + N]
    return tokens_BN, state["logprobs_BN"][:, :N], state["num_B"], state["hit_eos_B"], stats


def generate_speculative(
    model: Transformer,
    tokenizer,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    drafter: PromptLookup | DraftModel,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    n: int = 1,
    seed: int = 0,
    stop: str | Sequence[str] | None = None,
    eos_ids: Sequence[int] | None = None,
    length_bucket: int = 64,
    stats: dict | None = None,
) -> list[list[Completion]]:
    """`generate` with speculative decoding: the same completions (token-identical when greedy,
    the same distribution when sampling), fewer forward passes of `model` when drafts hit.

    Args:
      model: the `Transformer` that decides every token.
      tokenizer, prompts, max_new_tokens, temperature, top_p, top_k, n, seed, stop, eos_ids,
        length_bucket: as for `generate`.
      drafter: `PromptLookup(ngram, k)` or `DraftModel(model, k)` (same vocabulary as `model`).
      stats: if given, filled with this call's counts: "rounds" (forward passes of `model`
        after the prefill), "proposed" and "accepted" drafts, "generated" tokens and
        "acceptance" (accepted / proposed).

    Returns:
      Per prompt, its n `Completion`s, as `generate` returns them; log-probs are the raw
      model's (temperature 1, no top-k/top-p).

    Raises:
      ValueError: what `generate` rejects; a drafter that is neither kind, or a draft model
        with another vocabulary size.
    """
    _check(
        prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        n=n,
        length_bucket=length_bucket,
    )
    if not isinstance(drafter, PromptLookup | DraftModel):
        raise ValueError(f"drafter must be a PromptLookup or a DraftModel, got {drafter!r}")
    if isinstance(drafter, DraftModel) and (
        drafter.model.config.vocab_size != model.config.vocab_size
    ):
        raise ValueError(
            f"the draft model's vocab_size ({drafter.model.config.vocab_size}) differs from the "
            f"model's ({model.config.vocab_size}); a draft model must share the tokenizer"
        )
    ids, stop, eos_ids, pad_id = _prepare(
        model, tokenizer, prompts, [max_new_tokens] * len(prompts), stop, eos_ids
    )
    P = -(-max(len(p) for p in ids) // length_bucket) * length_bucket
    tokens_BP = np.full((len(ids), P), pad_id, np.int32)
    for row, p in zip(tokens_BP, ids, strict=True):
        row[P - len(p) :] = p
    tokens, logprobs, num, hit_eos, counts = jax.device_get(
        _speculate_padded(
            model,
            drafter,
            jnp.asarray(tokens_BP),
            jnp.asarray([len(p) for p in ids], jnp.int32),
            jnp.asarray(list(eos_ids) or [-1], jnp.int32),
            _keys(seed, None, len(ids)),
            jnp.float32(temperature),
            jnp.int32(top_k),
            jnp.float32(top_p),
            max_new_tokens=max_new_tokens,
            n=n,
        )
    )
    if stats is not None:
        stats.update({name: int(value) for name, value in counts.items()})
        stats["generated"] = int(num.sum())
        stats["acceptance"] = stats["accepted"] / max(stats["proposed"], 1)
    out = []
    for i in range(len(ids)):
        samples = []
        for j in range(i * n, (i + 1) * n):
            k = int(num[j])
            row_ids = [int(t) for t in tokens[j, :k]]
            row_lp = [float(x) for x in logprobs[j, :k]]
            samples.append(_finish(tokenizer, row_ids, row_lp, bool(hit_eos[j]), stop))
        out.append(samples)
    return out
