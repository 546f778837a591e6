"""Speculative rounds on the paged engine (`speculate`): the drafter proposes k tokens per row,
the model scores them in one forward, the rule in `_speculative` accepts a prefix.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from posttrain.models import Transformer, hidden_states, lm_logits
from posttrain.sampling._paged import (
    Rows,
    _paged,
    _sample_rows,
    _stacked,
    _token_logprobs,
    _unstacked,
)
from posttrain.sampling._speculative import (
    MTP,
    DraftModel,
    PromptLookup,
    _accept,
    _lookup,
    _Sampling,
)


def _per_row(rows: Rows, fn, *args):
    """`fn(sampling, *row_args)` for each row under its own `_Sampling` settings."""

    def one(temperature, top_k, top_p, *row_args):
        return fn(_Sampling(temperature, top_k, top_p), *row_args)

    return jax.vmap(one)(rows.temperature_B, rows.top_k_B, rows.top_p_B, *args)


def _propose(drafter, model, rows: Rows, t0_B, go_B, keys_B, tables_BM, block_size, greedy):
    """Drafts `[B, k]`, their distributions q `[B, k, V]` (None when greedy) and the drafter's
    pool: prompt lookup over the row's history; k+1 one-token steps of the draft model over
    [t0, d_1 .. d_k] (the last only to cache d_k, which is context if accepted); or k steps of
    the MTP module from position length - 1 (the model's hidden state there and t0, then its
    own output and each draft)."""
    K, V = drafter.k, rows.logits_BV.shape[-1]
    if isinstance(drafter, PromptLookup):
        drafts_BK = _lookup(rows.history_BT, rows.lengths_B + 1, ngram=drafter.ngram, k=K)
        return drafts_BK, None if greedy else jax.nn.one_hot(drafts_BK, V), None, None
    B = t0_B.shape[0]
    ones_B1 = jnp.ones((B, 1), jnp.int32)

    def draw(logits_BV, i):
        if greedy:
            return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), None
        q_BV = _per_row(rows, lambda s, logits_V: s.probs(logits_V), logits_BV)
        keys = jax.vmap(jax.random.fold_in, (0, None))(keys_B, 2 + i)
        return _per_row(rows, lambda s, key, q_V: s.draw(key, q_V[None])[0], keys, q_BV), q_BV

    if isinstance(drafter, MTP):
        mtp, start_B = drafter.module, rows.lengths_B - 1
        dtype, steps = model.config.dtype, K
    else:
        draft, start_B = drafter.model, rows.lengths_B
        dtype, steps = draft.config.dtype, K + 1

    def step(carry, i):
        k, v, token_B, h_BD = carry
        positions_B1 = (start_B + i)[:, None]
        cache = _paged(k, v, tables_BM, block_size, positions_B1, go_B, dtype)
        if isinstance(drafter, MTP):
            g_B1D, cache = mtp(
                model.params, token_B[:, None], h_BD[:, None], positions_B1, ones_B1, cache
            )
            h_BD, logits_BV = g_B1D[:, 0], lm_logits(model.params, g_B1D, model.config)[:, 0]
        else:
            logits_B1V, cache = draft(token_B[:, None], positions_B1, ones_B1, cache)
            logits_BV = logits_B1V[:, 0]
        token_B, q_BV = draw(logits_BV, i)
        return (cache.k_TNbKH, cache.v_TNbKH, token_B, h_BD), (token_B, q_BV)

    (k, v, _, _), (drafts_LB, q_LBV) = jax.lax.scan(
        step, (rows.draft_k, rows.draft_v, t0_B, rows.hidden_BD), jnp.arange(steps)
    )
    q_BKV = None if greedy else jnp.swapaxes(q_LBV[:K], 0, 1)
    return drafts_LB[:K].T, q_BKV, k, v


@functools.partial(
    jax.jit,
    static_argnames=("rounds", "blocks", "block_size", "greedy", "unstack"),
    donate_argnames=("rows",),
)
def speculate(
    model: Transformer,
    drafter: PromptLookup | DraftModel | MTP,
    rows: Rows,
    eos_E,
    *,
    rounds: int,
    blocks: int,
    block_size: int,
    greedy: bool,
    unstack: bool = True,
):
    """Up to `rounds` rounds of speculative decoding (it stops early once every row is done).

    A round emits each live row's first token t0 (the one the previous round drew, or for a
    row just prefilled, a draw from its prefill logits keyed like a plain decode step's), has
    the drafter propose k tokens after it, runs the model over [t0, d_1 .. d_k] at the row's
    positions `length .. length + k` (one forward), accepts a prefix of the drafts by the
    speculative-sampling rule (`_speculative._accept`), emits the accepted ones and draws the
    next t0 (from the residual after a rejection, from the model after k acceptances). A row
    emits 1 to k+1 tokens a round. `greedy` (every row at temperature 0): accept drafts while
    they are the model's argmax, no distributions. An MTP module then caches the model's
    hidden states at positions `length .. length + k - 1` with the drafts after them (the
    accepted ones are its context next round; the others are past the length). `unstack` as
    for `decode`.

    Returns (rows, tokens `[B, rounds * (k+1)]` in order, log-probs, which were emitted,
    (drafts proposed, drafts accepted, rounds run)).
    """
    K = drafter.k
    L = K + 1
    B = rows.lengths_B.shape[0]
    tables_BM = rows.tables_BM[:, :blocks]
    model, rows = _unstacked(model, rows) if unstack else (model, rows)
    j_1L = jnp.arange(L)[None]
    write = jax.vmap(lambda row, new, start: jax.lax.dynamic_update_slice(row, new, (start,)))

    def body(state):
        rows, r, tokens_RBL, logprobs_RBL, emitted_RBL, proposed, accepted = state
        live_B = ~rows.done_B
        fresh_B = rows.pending_B < 0
        first_keys_B = jax.vmap(jax.random.fold_in)(rows.keys_B, rows.num_B)
        drawn_B = jnp.argmax(rows.logits_BV, -1).astype(jnp.int32)
        if not greedy:
            drawn_B = _sample_rows(rows, first_keys_B)
        t0_B = jnp.where(fresh_B, drawn_B, rows.pending_B)
        lp0_B = jnp.where(
            fresh_B,
            _token_logprobs(rows.logits_BV[:, None], t0_B[:, None])[:, 0],
            rows.pending_lp_B,
        )
        num_B = rows.num_B + live_B
        done_B = rows.done_B | (live_B & jnp.isin(t0_B, eos_E)) | (num_B >= rows.budget_B)
        go_B = ~done_B  # rows that go on to verify drafts
        rows = rows._replace(history_BT=rows.history_BT.at[jnp.arange(B), rows.lengths_B].set(t0_B))
        round_keys_B = jax.vmap(lambda key, n: jax.random.fold_in(jax.random.fold_in(key, n), 1))(
            rows.keys_B, num_B
        )

        drafts_BK, q_BKV, draft_k, draft_v = _propose(
            drafter, model, rows, t0_B, go_B, round_keys_B, tables_BM, block_size, greedy
        )
        tokens_BL = jnp.concatenate([t0_B[:, None], drafts_BK], axis=1)
        positions_BL = rows.lengths_B[:, None] + j_1L
        cache = _paged(
            rows.k, rows.v, tables_BM, block_size, positions_BL, go_B, model.config.dtype
        )
        hidden_BLD, cache = hidden_states(
            model.params, tokens_BL, model.config, positions_BL, jnp.ones((B, L), jnp.int32), cache
        )
        logits_BLV = lm_logits(model.params, hidden_BLD, model.config)
        if greedy:
            best_BL = jnp.argmax(logits_BLV, axis=-1).astype(jnp.int32)
            accepted_B = jnp.sum(
                jnp.cumprod(drafts_BK == best_BL[:, :K], axis=1), axis=1, dtype=jnp.int32
            )
            next_B = jnp.take_along_axis(best_BL, accepted_B[:, None], axis=1)[:, 0]
        else:
            p_BLV = _per_row(rows, lambda s, logits_LV: s.probs(logits_LV), logits_BLV)
            keys_B = jax.vmap(jax.random.fold_in, (0, None))(round_keys_B, 0)

            def accept(s, key, p_LV, drafts_K, q_KV):
                a, t = _accept(key, p_LV[None], drafts_K[None], q_KV[None], s)
                return a[0], t[0]

            accepted_B, next_B = _per_row(rows, accept, keys_B, p_BLV, drafts_BK, q_BKV)

        hidden_BD = rows.hidden_BD
        if isinstance(drafter, MTP):
            positions_BK = positions_BL[:, :K]
            mtp_cache = _paged(
                draft_k, draft_v, tables_BM, block_size, positions_BK, go_B, model.config.dtype
            )
            _, mtp_cache = drafter.module(
                model.params,
                drafts_BK,
                hidden_BLD[:, :K],
                positions_BK,
                jnp.ones((B, K), jnp.int32),
                mtp_cache,
            )
            draft_k, draft_v = mtp_cache.k_TNbKH, mtp_cache.v_TNbKH
            last_BD = jnp.take_along_axis(hidden_BLD, accepted_B[:, None, None], axis=1)[:, 0]
            hidden_BD = jnp.where(go_B[:, None], last_BD.astype(hidden_BD.dtype), hidden_BD)

        # Emitted this round: t0, then drafts up to the accepted count, an EOS or the budget.
        k_1K = jnp.arange(K)[None]
        eos_BK = jnp.isin(drafts_BK, eos_E) & (k_1K < accepted_B[:, None])
        first_eos_B = jnp.where(jnp.any(eos_BK, axis=1), jnp.argmax(eos_BK, axis=1), K)
        count_B = jnp.minimum(jnp.minimum(accepted_B, first_eos_B + 1), rows.budget_B - num_B)
        count_B = jnp.where(go_B, count_B, 0)
        emitted_BL = (j_1L == 0) & live_B[:, None] | (j_1L >= 1) & (j_1L <= count_B[:, None])
        logprobs_BL = jnp.concatenate(
            [lp0_B[:, None], _token_logprobs(logits_BLV[:, :K], drafts_BK)], axis=1
        )
        next_lp_B = _token_logprobs(
            jnp.take_along_axis(logits_BLV, accepted_B[:, None, None], axis=1), next_B[:, None]
        )[:, 0]
        num_B = num_B + count_B
        done_B = done_B | (go_B & ((first_eos_B < count_B) | (num_B >= rows.budget_B)))
        rows = rows._replace(
            k=cache.k_TNbKH,
            v=cache.v_TNbKH,
            lengths_B=rows.lengths_B + jnp.where(go_B, accepted_B + 1, 0),
            num_B=num_B,
            done_B=done_B,
            pending_B=jnp.where(go_B, next_B, -1),
            pending_lp_B=next_lp_B,
            history_BT=write(rows.history_BT, tokens_BL, rows.lengths_B),
            draft_k=draft_k,
            draft_v=draft_v,
            hidden_BD=hidden_BD,
        )
        return (
            rows,
            r + 1,
            tokens_RBL.at[r].set(jnp.where(emitted_BL, tokens_BL, 0)),
            logprobs_RBL.at[r].set(jnp.where(emitted_BL, logprobs_BL, 0.0)),
            emitted_RBL.at[r].set(emitted_BL),
            proposed + K * jnp.sum(go_B),
            accepted + jnp.sum(jnp.where(go_B, accepted_B, 0)),
        )

    def running(state):
        return (state[1] < rounds) & ~jnp.all(state[0].done_B)

    zero = jnp.zeros((), jnp.int32)
    state = (
        rows,
        zero,
        jnp.zeros((rounds, B, L), jnp.int32),
        jnp.zeros((rounds, B, L), jnp.float32),
        jnp.zeros((rounds, B, L), bool),
        zero,
        zero,
    )
    rows, ran, tokens_RBL, logprobs_RBL, emitted_RBL, proposed, accepted = jax.lax.while_loop(
        running, body, state
    )

    def flat(x_RBL):
        return jnp.swapaxes(x_RBL, 0, 1).reshape(B, rounds * L)

    return (
        _stacked(rows) if unstack else rows,
        flat(tokens_RBL),
        flat(logprobs_RBL),
        flat(emitted_RBL),
        (proposed, accepted, ran),
    )
