"""The engine's device side: the rows' state, and the jitted prefill and decode steps over the
paged KV pool (speculative rounds: `_rounds`; `posttrain.sampling._engine` schedules them from
the host).

A row's sequence lives in the pool blocks its table names; position j of the row is at pool
slot `table[j // block] * block + j % block`, so each row writes its own positions and nothing
has to stay aligned across rows. That is what makes speculative decoding simple here: a round
writes the row's pending token and its k drafts at positions `length .. length + k`, and only
the accepted ones count towards `length`; the rejected drafts' slots are past the length (never
read) and the next round overwrites them. No masking, no compaction.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from posttrain.models import (
    PagedKVCache,
    Transformer,
    hidden_states,
    lm_logits,
    split_layers,
    token_logprobs,
    unstack_layers,
)
from posttrain.parallel import logical_to_spec, put
from posttrain.sampling._sample import draw_unfiltered, sample_tokens, unfiltered
from posttrain.sampling._speculative import MTP, DraftModel

SCRATCH = 0  # block 0: padding and finished rows write here; nothing reads it


class Rows(NamedTuple):
    """Device state of the decode rows."""

    k: jax.Array | dict | None  # the block pool, `[layers, blocks, block_size, K, H]` (NNX: None)
    v: jax.Array | dict | None
    tables_BM: jax.Array  # each row's block table
    lengths_B: jax.Array  # tokens in the cache
    logits_BV: jax.Array  # next-token logits after the prefill (and every plain decode step)
    num_B: jax.Array  # tokens generated (emitted)
    budget_B: jax.Array  # max_new_tokens of the row's request
    keys_B: jax.Array  # the request's PRNG key
    done_B: jax.Array  # finished or empty
    temperature_B: jax.Array  # the request's sampling settings
    top_k_B: jax.Array
    top_p_B: jax.Array
    # Speculative decoding only:
    pending_B: jax.Array  # the token a round drew last, emitted next round (-1: none yet)
    pending_lp_B: jax.Array  # its log-prob
    # The row's tokens by position (prompt, then generated): prompt lookup's drafts, and an
    # NNX module's cache (it reruns over them, `_nnx_step`).
    history_BT: jax.Array
    draft_k: jax.Array | None  # a draft model's (or MTP module's) pool: same blocks and tables
    draft_v: jax.Array | None
    hidden_BD: jax.Array | None  # MTP: the model's final hidden state at the last cached position
    # Router replay (`EngineConfig.record_routes`): each row's routed experts by position,
    # `[B, positions, MoE layers, top-k]` int16, prompt included.
    routes_BSTK: jax.Array | None = None


def _slots_of(tables_BM, block_size: int):
    """Pool slot of every position a block table covers: `[B, M * block_size]`."""
    B, M = tables_BM.shape
    offsets = jnp.arange(block_size, dtype=jnp.int32)
    return (tables_BM[:, :, None] * block_size + offsets).reshape(B, M * block_size)


@functools.partial(jax.jit, static_argnames=("block_size",), donate_argnames=("rows",))
def prefill(
    model: Transformer,
    drafter: DraftModel | MTP | None,
    rows: Rows,
    tokens_GP,
    lengths_G,
    starts_G,
    write_from_G,
    tables_GR,
    ring_rows_G,
    history_GT,
    pre_from_C,
    pre_to_C,
    copy_from_C,
    copy_to_C,
    rows_X,
    group_X,
    tables_XM,
    budget_X,
    key_data_X,
    samples_X,
    temperature_X,
    top_k_X,
    top_p_X,
    images_GIHWC=None,
    *,
    block_size: int,
):
    """Prefills G right-padded prompts into their blocks (`tables_GR`, R blocks covering the
    longest prompt) of the model's pool (and the drafter's), copies blocks `copy_from_C` to
    `copy_to_C` (the shared prompts' last blocks), and starts rows `rows_X` on prompt `group_X`
    with their own tables, budgets and keys (row x draws with `fold_in(key x, sample x)`, its
    request's key made from `key_data_X`). Repeated entries (padding) must repeat the same
    values. An MTP module caches positions 0 .. length - 2 (position i needs token i + 1).
    `images_GIHWC`: a VLM's prompt images (each prompt's image tokens take its images).

    A prompt whose first tokens are already in the pool passes only its tokens from `starts_G`
    on, which attend to the earlier positions through its table; positions from
    `write_from_G` on are written (a conversation's next turn writes its new tokens; the
    samples of a group admitted after its first ones write nothing: their last prompt block is
    copied in from `pre_from_C` to `pre_to_C` before the forward, and the pass only gives their
    next-token logits). `history_GT`: each prompt's tokens by position (prompt lookup; else
    one column)."""
    keys_X = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(key_data_X), samples_X)
    config = model.config
    G, P = tokens_GP.shape
    offsets_GP = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (G, P))
    positions_GP = starts_G[:, None] + offsets_GP
    real_GP = positions_GP < lengths_G[:, None]
    slots_GS = _slots_of(tables_GR, block_size)
    slot_GP = jnp.take_along_axis(slots_GS, jnp.minimum(positions_GP, slots_GS.shape[1] - 1), 1)
    writes_GP = real_GP & (positions_GP >= write_from_G[:, None])

    def pre_copy(store):
        if store is None:
            return None
        if not isinstance(store, dict):
            return store.at[:, pre_to_C].set(store[:, pre_from_C])
        return {**store, **{k: pre_copy(store[k]) for k in ("q", "scale")}}

    rows = rows._replace(k=pre_copy(rows.k), v=pre_copy(rows.v))

    def cache_of(k, v, dtype, real_GP=writes_GP):
        return PagedKVCache(
            k,
            v,
            write_slots_BL=jnp.where(real_GP, slot_GP, SCRATCH),
            tables_BM=tables_GR,
            lengths_B=lengths_G,
            dtype=jnp.dtype(dtype).name,
            ring_rows_B=ring_rows_G,
        )

    segments_GP = real_GP.astype(jnp.int32)
    routes_BSTK = rows.routes_BSTK
    images = dict(images_BIHWC=images_GIHWC)
    if config.nnx is not None:  # no pool: the rows' token histories are its cache
        cache = None
        hidden_GPD = hidden_states(model.params, tokens_GP, config, positions_GP, segments_GP)
    elif routes_BSTK is None:
        cache = cache_of(rows.k, rows.v, config.dtype)
        hidden_GPD, cache = hidden_states(
            model.params, tokens_GP, config, positions_GP, segments_GP, cache, **images
        )
    else:  # the prompt's routing, for each of its rows (a group's samples share its prefill)
        cache = cache_of(rows.k, rows.v, config.dtype)
        hidden_GPD, cache, aux = hidden_states(
            model.params, tokens_GP, config, positions_GP, segments_GP, cache, return_aux=True,
            **images,
        )  # fmt: skip
        routes_XPTK = aux["routed_experts"][group_X].astype(routes_BSTK.dtype)
        routes_BSTK = routes_BSTK.at[rows_X[:, None], jnp.arange(P)].set(routes_XPTK, mode="drop")
    last_G1D = jnp.take_along_axis(hidden_GPD, (lengths_G - starts_G - 1)[:, None, None], axis=1)
    logits_GV = lm_logits(model.params, last_G1D, config)[:, 0]
    draft_k, draft_v, hidden_BD = rows.draft_k, rows.draft_v, rows.hidden_BD
    if isinstance(drafter, DraftModel):
        draft = drafter.model
        draft_cache = cache_of(draft_k, draft_v, draft.config.dtype)
        _, draft_cache = hidden_states(
            draft.params, tokens_GP, draft.config, positions_GP, segments_GP, draft_cache
        )
        draft_k, draft_v = draft_cache.k_TNbKH, draft_cache.v_TNbKH
    elif isinstance(drafter, MTP):
        known_GP = positions_GP < (lengths_G - 1)[:, None]
        draft_cache = cache_of(draft_k, draft_v, config.dtype, known_GP)
        next_GP = jnp.pad(tokens_GP[:, 1:], ((0, 0), (0, 1)))
        _, draft_cache = drafter.module(
            model.params, next_GP, hidden_GPD, positions_GP, known_GP.astype(jnp.int32), draft_cache
        )
        draft_k, draft_v = draft_cache.k_TNbKH, draft_cache.v_TNbKH
        hidden_BD = hidden_BD.at[rows_X].set(last_G1D[group_X, 0].astype(hidden_BD.dtype))

    def copy(store):
        """The shared prompts' last blocks to their copies; a layered pool's ring rows from
        each prompt's first sample to its others."""
        if store is None:
            return None
        if not isinstance(store, dict):
            return store.at[:, copy_to_C].set(store[:, copy_from_C])
        out = {k: copy(store[k]) for k in ("q", "scale")}
        if "recent" in store:
            ring = store["recent"]
            out["recent"] = ring.at[:, rows_X].set(ring[:, ring_rows_G[group_X]])
        return out

    return Rows(
        k=None if cache is None else copy(cache.k_TNbKH),
        v=None if cache is None else copy(cache.v_TNbKH),
        tables_BM=rows.tables_BM.at[rows_X].set(tables_XM),
        lengths_B=rows.lengths_B.at[rows_X].set(lengths_G[group_X]),
        logits_BV=rows.logits_BV.at[rows_X].set(logits_GV[group_X]),
        num_B=rows.num_B.at[rows_X].set(0),
        budget_B=rows.budget_B.at[rows_X].set(budget_X),
        keys_B=rows.keys_B.at[rows_X].set(keys_X),
        done_B=rows.done_B.at[rows_X].set(False),
        temperature_B=rows.temperature_B.at[rows_X].set(temperature_X),
        top_k_B=rows.top_k_B.at[rows_X].set(top_k_X),
        top_p_B=rows.top_p_B.at[rows_X].set(top_p_X),
        pending_B=rows.pending_B.at[rows_X].set(-1),
        pending_lp_B=rows.pending_lp_B,
        history_BT=rows.history_BT.at[rows_X].set(history_GT[group_X]),
        draft_k=copy(draft_k),
        draft_v=copy(draft_v),
        hidden_BD=hidden_BD,
        routes_BSTK=routes_BSTK,
    )


def _sample_rows(rows: Rows, keys_B):
    """Each row's next token from `logits_BV` under its own settings (greedy rows and rows
    without top-k/top-p need no vocabulary sort: when no row filters, none sorts)."""

    def one(key, logits_V, temperature, top_k, top_p):
        return sample_tokens(
            key, logits_V[None], temperature=temperature, top_k=top_k, top_p=top_p
        )[0]

    def sampled():
        return jax.vmap(one)(keys_B, rows.logits_BV, rows.temperature_B, rows.top_k_B, rows.top_p_B)

    def greedy():
        return jnp.argmax(rows.logits_BV, axis=-1).astype(jnp.int32)

    def plain():
        drawn_B = jax.vmap(lambda k, l_V, t: draw_unfiltered(k, l_V[None], t)[0])(
            keys_B, rows.logits_BV, rows.temperature_B
        )
        return jnp.where(rows.temperature_B > 0, drawn_B, greedy())

    no_sort_B = (rows.temperature_B == 0) | unfiltered(rows.top_k_B, rows.top_p_B)
    branch = jnp.where(jnp.all(rows.temperature_B == 0), 0, jnp.where(jnp.all(no_sort_B), 1, 2))
    return jax.lax.switch(branch, (greedy, plain, sampled))


def _token_logprobs(logits_BXV, tokens_BX):
    """log softmax(logits)[token], the raw model's log-probs `[B, X]`."""
    logp_BXV = jax.nn.log_softmax(logits_BXV.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp_BXV, tokens_BX[..., None], axis=-1)[..., 0]


def _paged(k, v, tables_BM, block_size, positions_BL, write_B, dtype, kernel="") -> PagedKVCache:
    """A cache for a pass writing each row's tokens at `positions_BL` (rows not in `write_B`
    write to scratch) and reading its positions up to the last of them."""
    slots_BS = _slots_of(tables_BM, block_size)
    slot_BL = jnp.take_along_axis(
        slots_BS, jnp.minimum(positions_BL, slots_BS.shape[1] - 1), axis=1
    )
    return PagedKVCache(
        k,
        v,
        write_slots_BL=jnp.where(write_B[:, None], slot_BL, SCRATCH),
        tables_BM=tables_BM,
        lengths_B=positions_BL[:, -1] + 1,
        dtype=jnp.dtype(dtype).name,
        kernel=kernel,
        ring_rows_B=jnp.arange(positions_BL.shape[0], dtype=jnp.int32),
    )


@functools.partial(
    jax.jit,
    static_argnames=("steps", "blocks", "block_size", "kernel", "unstack"),
    donate_argnames=("rows",),
)
def decode(
    model: Transformer, rows: Rows, eos_E, *, steps, blocks, block_size, kernel="", unstack=True
):
    """`steps` decode steps of every row, attending over each row's first `blocks` blocks;
    returns (rows, tokens `[B, steps]`, log-probs, which of them were generated). `unstack`:
    the layers' weights and pool as per-layer arrays for the call (`_unstacked`)."""
    config = model.config
    B = rows.lengths_B.shape[0]
    tables_BM = rows.tables_BM[:, :blocks]
    unstack = unstack and config.nnx is None  # (an NNX module's params are its own)
    model, rows = _unstacked(model, rows) if unstack else (model, rows)

    def body(rows: Rows, _):
        keys_B = jax.vmap(jax.random.fold_in)(rows.keys_B, rows.num_B)
        token_B = _sample_rows(rows, keys_B)
        logprobs = token_logprobs if config.batch_invariant else _token_logprobs  # the trainer's
        logprob_B = logprobs(rows.logits_BV[:, None], token_B[:, None])[:, 0]
        live_B = ~rows.done_B
        token_B = jnp.where(live_B, token_B, 0)
        num_B = rows.num_B + live_B
        done_B = rows.done_B | jnp.isin(token_B, eos_E) | (num_B >= rows.budget_B)
        position_B1 = rows.lengths_B[:, None]
        segments_B1 = jnp.ones((B, 1), jnp.int32)
        if config.nnx is not None:
            rows, logits_B1V = _nnx_step(model, rows, token_B, live_B, blocks * block_size)
            cache = None
        elif rows.routes_BSTK is None:
            cache = _paged(
                rows.k, rows.v, tables_BM, block_size, position_B1, live_B, config.dtype, kernel
            )
            logits_B1V, cache = model(token_B[:, None], position_B1, segments_B1, cache)
        else:  # record the token's routing at its position
            cache = _paged(
                rows.k, rows.v, tables_BM, block_size, position_B1, live_B, config.dtype, kernel
            )
            hidden_B1D, cache, aux = hidden_states(
                model.params, token_B[:, None], config, position_B1, segments_B1, cache,
                return_aux=True,
            )  # fmt: skip
            logits_B1V = lm_logits(model.params, hidden_B1D, config)
            where_B = jnp.where(live_B, rows.lengths_B, rows.routes_BSTK.shape[1])  # else: drop
            step_BTK = aux["routed_experts"][:, 0].astype(rows.routes_BSTK.dtype)
            rows = rows._replace(
                routes_BSTK=rows.routes_BSTK.at[jnp.arange(B), where_B].set(step_BTK, mode="drop")
            )
        rows = rows._replace(
            k=rows.k if cache is None else cache.k_TNbKH,
            v=rows.v if cache is None else cache.v_TNbKH,
            lengths_B=rows.lengths_B + live_B,
            logits_BV=logits_B1V[:, 0],
            num_B=num_B,
            done_B=done_B,
        )
        return rows, (token_B, jnp.where(live_B, logprob_B, 0.0), live_B)

    rows, (tokens_KB, logprobs_KB, live_KB) = jax.lax.scan(body, rows, length=steps)
    return _stacked(rows) if unstack else rows, tokens_KB.T, logprobs_KB.T, live_KB.T


def _nnx_step(model: Transformer, rows: Rows, token_B, live_B, span: int):
    """A decode step of a Flax NNX module, which has no KV cache to page: each live row writes
    its token into its history at its length, and the module runs over the histories' first
    `span` positions (every row's length is below it), each row's logits read at its token.
    Positions past a row's token are later in the causal order, so they are never attended."""
    history_BT = rows.history_BT
    B, T = history_BT.shape
    at_B = jnp.where(live_B, rows.lengths_B, T)  # finished rows write nothing (dropped)
    history_BT = history_BT.at[jnp.arange(B), at_B].set(token_B, mode="drop")
    positions_BS = jnp.broadcast_to(jnp.arange(span, dtype=jnp.int32), (B, span))
    segments_BS = (positions_BS <= rows.lengths_B[:, None]).astype(jnp.int32)
    hidden_BSD = hidden_states(
        model.params, history_BT[:, :span], model.config, positions_BS, segments_BS
    )
    at_B11 = jnp.minimum(rows.lengths_B, span - 1)[:, None, None]
    hidden_B1D = jnp.take_along_axis(hidden_BSD, at_B11, axis=1)
    return rows._replace(history_BT=history_BT), lm_logits(model.params, hidden_B1D, model.config)


def _unstacked(model: Transformer, rows: Rows):
    """The model's layers and the pool as per-layer arrays for a call's steps
    (`unstack_layers`): a scan over the stacks would slice (copy) every layer's weights and
    cache at every step; this copies them once per call (the weights' copy lives for the call)."""
    T = model.config.num_layers
    k, v = split_layers(rows.k, T), None if rows.v is None else split_layers(rows.v, T)
    return Transformer(unstack_layers(model.params), model.config), rows._replace(k=k, v=v)


def _stacked(rows: Rows) -> Rows:
    """`_unstacked`'s pool back in one stacked array (or dict of them)."""

    def stack(layers):
        return None if layers is None else jax.tree.map(lambda *a: jnp.stack(a), *layers)

    return rows._replace(k=stack(rows.k), v=stack(rows.v))


def empty_rows(
    model_config,
    config,
    num_blocks: int,
    blocks_per_seq: int,
    *,
    combined: bool,
    history: int = 1,
    draft_config=None,
    mtp: bool = False,
) -> Rows:
    """The engine's device state with no request in it (a pure function: `jax.eval_shape`
    gives its shapes for ahead-of-time compilation); `config` is the `EngineConfig`,
    `history` the positions a row's token history holds (prompt lookup), `draft_config` the
    config of the draft model or MTP block (its pool), `mtp` whether rows keep the model's
    last hidden state."""
    B = config.slots
    k = v = None  # an NNX module has no pool (its rows' token histories are its cache)
    if model_config.nnx is None:
        k, v = PagedKVCache.init_pool(
            model_config,
            num_blocks,
            config.block_size,
            config.kv_dtype,
            combined=combined,
            ring_rows=B,
            recent=config.kv_recent,
        )
    draft_k = draft_v = None
    if draft_config is not None:
        draft_k, draft_v = PagedKVCache.init_pool(draft_config, num_blocks, config.block_size)

    def ints():  # separate buffers: the state is donated
        return jnp.zeros((B,), jnp.int32)

    return Rows(
        k=k,
        v=v,
        tables_BM=jnp.zeros((B, blocks_per_seq), jnp.int32),
        lengths_B=ints(),
        logits_BV=jnp.zeros((B, model_config.vocab_size), jnp.float32),
        num_B=ints(),
        budget_B=ints(),
        keys_B=jax.random.split(jax.random.key(0), B),
        done_B=jnp.ones((B,), bool),
        temperature_B=jnp.zeros((B,), jnp.float32),
        top_k_B=ints(),
        top_p_B=jnp.ones((B,), jnp.float32),
        pending_B=jnp.full((B,), -1, jnp.int32),
        pending_lp_B=jnp.zeros((B,), jnp.float32),
        history_BT=jnp.zeros((B, history), jnp.int32),
        draft_k=draft_k,
        draft_v=draft_v,
        hidden_BD=jnp.zeros((B, model_config.embed_dim), model_config.dtype) if mtp else None,
        routes_BSTK=_routes(model_config, B, blocks_per_seq * config.block_size)
        if config.record_routes
        else None,
    )


def _routes(model_config, rows: int, positions: int) -> jax.Array:
    """Empty router-replay records: `[rows, positions, MoE layers, top-k]` int16 expert ids."""
    shape = (rows, positions, model_config.num_moe_layers, model_config.moe.top_k)
    return jnp.zeros(shape, jnp.int16)


_POOLS = ("k", "v", "draft_k", "draft_v")  # split over the tensor axis like the model's heads


def on_devices_of(rows: Rows, params) -> Rows:
    """`rows` placed where the model's `params` are: replicated over their mesh, except the
    pools, whose kv heads split over its tensor axis like the model's (params on one device:
    everything there)."""
    placed = jax.tree.leaves(params)[0].sharding
    if not isinstance(placed, jax.sharding.NamedSharding):
        return jax.device_put(rows, placed)
    return put(rows, rows_shardings(rows, placed.mesh))  # (a mesh across processes: each
    # process makes its own shards)


def rows_shardings(rows: Rows, mesh) -> Rows:
    """How the engine lays out its rows on `mesh` (`on_devices_of`; for `jax.eval_shape`d rows
    too): replicated, but the pools' kv heads, split over the tensor axis."""

    def pool_sharding(x):
        axes = (None, None, None, "act_kv_heads", None)[: x.ndim]
        return jax.sharding.NamedSharding(mesh, logical_to_spec(axes, x.shape, mesh))

    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    shardings = rows._replace(
        **{f: jax.tree.map(lambda _: replicated, getattr(rows, f)) for f in rows._fields},
    )
    return shardings._replace(**{f: jax.tree.map(pool_sharding, getattr(rows, f)) for f in _POOLS})
