"""Continuous batching: a fixed set of decode slots, each refilled with the next waiting request
as soon as its sequence ends, so one long completion does not idle the rest of the batch.

The cache is a ring of S = bucket(longest prompt) + max(max_new_tokens) slots per row, and every
row writes its decoded token at the same ring slot `step % S` (the model's `KVCache` has one
write index for all rows). A request placed in a row at step g gets its prompt at the P slots
just before g, so its whole life (P + its new tokens <= S) fits in the ring without overwriting
itself; what the row's previous request left gets segment id -1 and is never attended.
Attention masks by position and segment id, not by slot order, so positions count from 0 at each
prompt's first token as in `generate`, and nothing in the model changes.

The host refills finished slots between jitted chunks of `chunk` decode steps: it syncs once per
chunk, not per token, and a finished row idles at most `chunk - 1` steps.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.models import KVCache, Transformer, hidden_states, lm_logits
from posttrain.sampling._generate import Completion, _check, _finish, _prepare
from posttrain.sampling._sample import sample_tokens


class _Slots(NamedTuple):
    """Device state of the decode slots (B rows)."""

    cache: KVCache  # ring of S slots per row; `cache.index` is unused (set from `step`)
    logits_BV: jax.Array  # next-token logits of each row
    positions_B: jax.Array  # position of the token each row feeds next
    num_B: jax.Array  # tokens generated so far by the row's request
    budget_B: jax.Array  # the request's max_new_tokens
    request_B: jax.Array  # the request's id (seeds its sampling)
    done_B: jax.Array  # finished or empty: generates nothing
    step: jax.Array  # decode steps taken; the ring slot written next is step % S


def _init_slots(config, slots: int, length: int) -> _Slots:
    def zeros_B():  # separate buffers: the state is donated
        return jnp.zeros((slots,), jnp.int32)

    return _Slots(
        cache=KVCache.init(config, slots, length),
        logits_BV=jnp.zeros((slots, config.vocab_size), jnp.float32),
        positions_B=zeros_B(),
        num_B=zeros_B(),
        budget_B=zeros_B(),
        request_B=zeros_B(),
        done_B=jnp.ones((slots,), bool),
        step=jnp.zeros((), jnp.int32),
    )


@functools.partial(jax.jit, donate_argnames=("state",))
def _prefill(model: Transformer, state: _Slots, tokens_GP, lengths_G, rows_G, request_G, budget_G):
    """Prefill G left-padded prompts and place them in rows `rows_G`, their prompt in the ring
    slots just before `state.step`. Repeated rows must repeat the same request."""
    config, params, cache = model.config, model.params, state.cache
    G, P = tokens_GP.shape
    S = cache.positions_BS.shape[1]
    pad_G1 = (P - lengths_G)[:, None]
    slot_1P = jnp.arange(P, dtype=jnp.int32)[None]
    real_GP = slot_1P >= pad_G1
    positions_GP = jnp.where(real_GP, slot_1P - pad_G1, 0)
    hidden_GPD, fresh = hidden_states(
        params,
        tokens_GP,
        config,
        positions_GP,
        real_GP.astype(jnp.int32),
        KVCache.init(config, G, P),
    )
    logits_GV = lm_logits(params, hidden_GPD[:, -1:], config)[:, 0]

    # Ring slot s holds prompt slot j = s - (step - P) (mod S); slots with j >= P are emptied.
    j_S = (jnp.arange(S, dtype=jnp.int32) - (state.step - P)) % S
    used_S = j_S < P
    take_S = jnp.minimum(j_S, P - 1)

    def place(x, empty, axis):
        x = jnp.take(x, take_S, axis=axis)
        used = used_S.reshape((S,) + (1,) * (x.ndim - axis - 1))
        return jnp.where(used, x, empty)

    cache = KVCache(
        k_TBSKH=cache.k_TBSKH.at[:, rows_G].set(place(fresh.k_TBSKH, 0, 2)),
        v_TBSKH=cache.v_TBSKH.at[:, rows_G].set(place(fresh.v_TBSKH, 0, 2)),
        positions_BS=cache.positions_BS.at[rows_G].set(place(fresh.positions_BS, 0, 1)),
        segment_ids_BS=cache.segment_ids_BS.at[rows_G].set(place(fresh.segment_ids_BS, -1, 1)),
        index=cache.index,
    )
    return state._replace(
        cache=cache,
        logits_BV=state.logits_BV.at[rows_G].set(logits_GV),
        positions_B=state.positions_B.at[rows_G].set(lengths_G),
        num_B=state.num_B.at[rows_G].set(0),
        budget_B=state.budget_B.at[rows_G].set(budget_G),
        request_B=state.request_B.at[rows_G].set(request_G),
        done_B=state.done_B.at[rows_G].set(False),
    )


@functools.partial(jax.jit, static_argnames=("steps",), donate_argnames=("state",))
def _decode(model: Transformer, state: _Slots, eos_E, rng, temperature, top_k, top_p, *, steps):
    """`steps` decode steps of every row; returns (state, tokens `[B, steps]`, log-probs, which
    of them were generated)."""
    B, S = state.cache.positions_BS.shape

    def sample(keys_B, logits_BV):
        one = functools.partial(sample_tokens, temperature=temperature, top_k=top_k, top_p=top_p)
        return jax.vmap(lambda key, logits_V: one(key, logits_V[None])[0])(keys_B, logits_BV)

    def body(state, _):
        # A request's k-th token uses key (seed, request, k): outputs do not depend on the slot
        # or on what else is running.
        keys_B = jax.vmap(lambda r, k: jax.random.fold_in(jax.random.fold_in(rng, r), k))(
            state.request_B, state.num_B
        )
        token_B = sample(keys_B, state.logits_BV)
        logprob_B = jnp.take_along_axis(
            jax.nn.log_softmax(state.logits_BV, axis=-1), token_B[:, None], axis=-1
        )[:, 0]
        live_B = ~state.done_B
        token_B = jnp.where(live_B, token_B, 0)
        num_B = state.num_B + live_B
        done_B = state.done_B | jnp.isin(token_B, eos_E) | (num_B >= state.budget_B)
        cache = dataclasses.replace(state.cache, index=state.step % S)
        logits_B1V, cache = model(
            token_B[:, None], state.positions_B[:, None], jnp.ones((B, 1), jnp.int32), cache
        )
        state = _Slots(
            cache=cache,
            logits_BV=logits_B1V[:, 0],
            positions_B=state.positions_B + 1,
            num_B=num_B,
            budget_B=state.budget_B,
            request_B=state.request_B,
            done_B=done_B,
            step=state.step + 1,
        )
        return state, (token_B, jnp.where(live_B, logprob_B, 0.0), live_B)

    state, (tokens_KB, logprobs_KB, live_KB) = jax.lax.scan(body, state, length=steps)
    return state, tokens_KB.T, logprobs_KB.T, live_KB.T


def generate_continuous(
    model: Transformer,
    tokenizer,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int],
    slots: int = 8,
    chunk: int = 8,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    n: int = 1,
    seed: int = 0,
    stop: str | Sequence[str] | None = None,
    eos_ids: Sequence[int] | None = None,
    length_bucket: int = 64,
) -> list[list[Completion]]:
    """Like `generate`, but with continuous batching: `slots` rows decode at once and a row whose
    sample ends takes the next waiting one, so a few long samples do not idle the batch.

    Args:
      model: the `Transformer` (its params are a jit argument: new weights do not recompile).
      tokenizer: a `posttrain.data.Tokenizer`, or None for token-id prompts.
      prompts: rendered prompt strings or token-id lists, as for `generate`.
      max_new_tokens: most tokens generated per sample; one int, or one per prompt.
      slots: rows decoded together (the batch size; the cache holds this many rows).
      chunk: decode steps per jitted call; the host refills finished rows between calls.
      temperature, top_p, top_k, stop, eos_ids, length_bucket: as for `generate`.
      n: samples per prompt; each is its own request (its prompt is prefilled again, not shared).
      seed: PRNG seed; a sample's tokens depend on (seed, prompt index, sample index), not on
        `slots`, `chunk` or the other prompts (up to float rounding, which varies with batch).

    Returns:
      Per prompt, a list of its n `Completion`s. Greedy outputs equal `generate`'s.

    Raises:
      ValueError: as `generate`, plus slots or chunk < 1, or a max_new_tokens list whose length
        is not the number of prompts.
    """
    budgets = (
        [max_new_tokens] * len(prompts)
        if isinstance(max_new_tokens, int | np.integer)
        else [int(m) for m in max_new_tokens]
    )
    if len(budgets) != len(prompts):
        raise ValueError(
            f"max_new_tokens has {len(budgets)} entries for {len(prompts)} prompts; pass one "
            f"int or one per prompt"
        )
    _check(
        prompts,
        max_new_tokens=min(budgets),
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        n=n,
        length_bucket=length_bucket,
    )
    if slots < 1 or chunk < 1:
        raise ValueError(f"slots and chunk must be >= 1, got slots={slots}, chunk={chunk}")
    ids, stop, eos_ids, pad_id = _prepare(model, tokenizer, prompts, budgets, stop, eos_ids)
    eos = frozenset(int(e) for e in eos_ids)

    def bucket(length):
        return -(-length // length_bucket) * length_bucket

    ring = bucket(max(map(len, ids))) + max(budgets)
    state = _init_slots(model.config, slots, ring)
    args = (
        jnp.asarray(sorted(eos) or [-1], jnp.int32),
        jax.random.key(seed),
        jnp.float32(temperature),
        jnp.int32(top_k),
        jnp.float32(top_p),
    )
    waiting = collections.deque(range(len(ids) * n))  # request r is sample r % n of prompt r // n
    tokens = {r: [] for r in waiting}
    logprobs = {r: [] for r in waiting}
    row_request: list[int | None] = [None] * slots
    finished = {}
    while waiting or any(r is not None for r in row_request):
        free = [b for b, r in enumerate(row_request) if r is None]
        if free and waiting:
            group = [(b, waiting.popleft()) for b in free[: len(waiting)]]
            # Pad the group to a power of two (repeating its last entry) to bound compilations.
            padded = group + group[-1:] * ((1 << (len(group) - 1).bit_length()) - len(group))
            P = bucket(max(len(ids[r // n]) for _, r in group))
            tokens_GP = np.full((len(padded), P), pad_id, np.int32)
            for row, (_, r) in zip(tokens_GP, padded, strict=True):
                p = ids[r // n]
                row[P - len(p) :] = p
            state = _prefill(
                model,
                state,
                jnp.asarray(tokens_GP),
                jnp.asarray([len(ids[r // n]) for _, r in padded], jnp.int32),
                jnp.asarray([b for b, _ in padded], jnp.int32),
                jnp.asarray([r for _, r in padded], jnp.int32),
                jnp.asarray([budgets[r // n] for _, r in padded], jnp.int32),
            )
            for b, r in group:
                row_request[b] = r
        state, tok_BK, lp_BK, live_BK = _decode(model, state, *args, steps=chunk)
        tok_BK, lp_BK, live_BK, done_B = jax.device_get((tok_BK, lp_BK, live_BK, state.done_B))
        for b, r in enumerate(row_request):
            if r is None:
                continue
            live = live_BK[b]
            tokens[r] += tok_BK[b, live].tolist()
            logprobs[r] += lp_BK[b, live].tolist()
            if done_B[b]:
                hit_eos = bool(tokens[r]) and tokens[r][-1] in eos
                finished[r] = _finish(tokenizer, tokens[r], logprobs[r], hit_eos, stop)
                row_request[b] = None
    return [[finished[i * n + j] for j in range(n)] for i in range(len(ids))]
