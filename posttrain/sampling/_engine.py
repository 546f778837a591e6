"""The generation engine: a paged KV cache, continuous batching and prefix sharing.

Requests wait in a queue; `slots` rows decode together, and a row whose sample ends takes the
next request between jitted chunks of `chunk` decode steps, so one long answer does not idle
the batch. Keys and values live in a pool of fixed-size blocks (`PagedKVCache`): a request is
admitted when the pool has the blocks its prompt and token budget need, not when a row of
`max_len` slots is free, and gives them back when it ends.

The n samples of a prompt (a GRPO group) share its blocks: the prompt is prefilled once, into
the first sample's blocks; every other sample points its block table at the same full blocks
and gets its own copy of the last, partly filled one (copy-on-write at the first block they
can differ in). Block reference counts free a shared block when its last user ends.

Sampling is keyed per request: sample j of prompt i draws its k-th token with
`fold_in(fold_in(key_i, j), k)`, where `key_i` is the prompt's own seed (`seeds`) or
`fold_in(key(seed), i)`; so outputs do not depend on the slot, the chunk or what else runs, and
with `seeds` they are the static sampler's draws (`generate(..., seeds=...)` keys the same way).
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

from posttrain.models import KV_DTYPES, PagedKVCache, Transformer, hidden_states, lm_logits
from posttrain.parallel import logical_to_spec
from posttrain.sampling._sample import sample_tokens

_SCRATCH = 0  # block 0: padding and finished rows write here; nothing reads it
_ATTENTION = ("auto", "xla", "ragged")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine batches and caches.

    Attributes:
      slots: sequences decoded together (the decode batch).
      block_size: tokens per KV block.
      num_blocks: blocks in the pool (block 0 is scratch); 0 sizes it so every slot can hold
        a sequence of the longest length the engine is asked for (never waits for blocks).
      chunk: decode steps per device call; finished rows are refilled between calls.
      prefill_bucket: prompt lengths are padded to a multiple of this for prefill (bounds
        compilations).
      kv_dtype: "auto" (the model's compute dtype), "int8" (per-token, per-head scales) or
        "int8_layered" (int8, and each sequence's last `kv_recent` tokens in full precision).
      kv_recent: the full-precision window of "int8_layered".
      prefix_sharing: the n samples of a prompt share its prefill and its full blocks.
      attention: how decode steps attend over the pool: "auto" (the TPU ragged paged-attention
        kernel on TPU where it applies: model-dtype KV, no MLA, head dim a multiple of 128;
        else "xla"), "xla" (gather the row's blocks, the reference), "ragged" (the kernel).
    """

    slots: int = 8
    block_size: int = 16
    num_blocks: int = 0
    chunk: int = 16
    prefill_bucket: int = 16
    kv_dtype: str = "auto"
    kv_recent: int = 32
    prefix_sharing: bool = True
    attention: str = "auto"

    def __post_init__(self):
        for name in ("slots", "block_size", "chunk", "prefill_bucket", "kv_recent"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine {name} must be >= 1, got {getattr(self, name)}")
        if self.num_blocks < 0:
            raise ValueError(
                f"engine num_blocks must be >= 0 (0 = sized to fit), got {self.num_blocks}"
            )
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"engine kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        if self.attention not in _ATTENTION:
            raise ValueError(
                f"engine attention must be one of {_ATTENTION}, got {self.attention!r}"
            )

    def kernel(self, model_config, platform: str) -> str:
        """The `PagedKVCache.kernel` decode steps use ("" for the XLA gather)."""
        fits = (
            self.kv_dtype == "auto"
            and model_config.mla is None
            and model_config.head_dim % 128 == 0
        )
        if self.attention == "auto":
            return "ragged" if platform == "tpu" and fits else ""
        if self.attention == "xla":
            return ""
        if not fits:
            raise ValueError(
                f"engine attention={self.attention!r} needs a model-dtype KV cache (kv_dtype="
                f"'auto'), no MLA and a head dim that is a multiple of 128; use 'xla'"
            )
        return self.attention


class _Rows(NamedTuple):
    """Device state of the decode rows."""

    k: jax.Array | dict  # the block pool, `[layers, blocks * block_size, K, H]`
    v: jax.Array | dict
    tables_BM: jax.Array  # each row's block table
    lengths_B: jax.Array  # tokens in the cache (prompt + generated and fed back)
    logits_BV: jax.Array  # next-token logits
    num_B: jax.Array  # tokens generated
    budget_B: jax.Array  # max_new_tokens of the row's request
    keys_B: jax.Array  # the request's PRNG key
    done_B: jax.Array  # finished or empty
    temperature_B: jax.Array  # the request's sampling settings
    top_k_B: jax.Array
    top_p_B: jax.Array


def _slots_of(tables_BM, block_size: int):
    """Pool slot of every position a block table covers: `[B, M * block_size]`."""
    B, M = tables_BM.shape
    offsets = jnp.arange(block_size, dtype=jnp.int32)
    return (tables_BM[:, :, None] * block_size + offsets).reshape(B, M * block_size)


@functools.partial(jax.jit, static_argnames=("block_size",), donate_argnames=("rows",))
def _prefill(
    model: Transformer,
    rows: _Rows,
    tokens_GP,
    lengths_G,
    tables_GR,
    ring_rows_G,
    copy_from_C,
    copy_to_C,
    rows_X,
    group_X,
    tables_XM,
    budget_X,
    keys_X,
    temperature_X,
    top_k_X,
    top_p_X,
    *,
    block_size: int,
):
    """Prefills G right-padded prompts into their blocks (`tables_GR`, R blocks covering the
    padded length), copies blocks `copy_from_C` to `copy_to_C` (the shared prompts' last
    blocks), and starts rows `rows_X` on prompt `group_X` with their own tables, budgets and
    keys. Repeated entries (padding) must repeat the same values."""
    config = model.config
    G, P = tokens_GP.shape
    positions_GP = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (G, P))
    real_GP = positions_GP < lengths_G[:, None]
    slots_GS = _slots_of(tables_GR, block_size)
    cache = PagedKVCache(
        rows.k,
        rows.v,
        write_slots_BL=jnp.where(real_GP, slots_GS[:, :P], _SCRATCH),
        tables_BM=tables_GR,
        lengths_B=lengths_G,
        dtype=jnp.dtype(config.dtype).name,
        ring_rows_B=ring_rows_G,
    )
    hidden_GPD, cache = hidden_states(
        model.params, tokens_GP, config, positions_GP, real_GP.astype(jnp.int32), cache
    )
    last_G1D = jnp.take_along_axis(hidden_GPD, (lengths_G - 1)[:, None, None], axis=1)
    logits_GV = lm_logits(model.params, last_G1D, config)[:, 0]

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

    k, v = copy(cache.k_TNbKH), copy(cache.v_TNbKH)
    return _Rows(
        k=k,
        v=v,
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
    )


def _sample_rows(rows: _Rows, keys_B):
    """Each row's next token under its own settings (all greedy: one argmax, no sort)."""

    def one(key, logits_V, temperature, top_k, top_p):
        return sample_tokens(
            key, logits_V[None], temperature=temperature, top_k=top_k, top_p=top_p
        )[0]

    def sampled():
        return jax.vmap(one)(keys_B, rows.logits_BV, rows.temperature_B, rows.top_k_B, rows.top_p_B)

    def greedy():
        return jnp.argmax(rows.logits_BV, axis=-1).astype(jnp.int32)

    return jax.lax.cond(jnp.all(rows.temperature_B == 0), greedy, sampled)


@functools.partial(
    jax.jit, static_argnames=("steps", "blocks", "block_size", "kernel"), donate_argnames=("rows",)
)
def _decode(model: Transformer, rows: _Rows, eos_E, *, steps, blocks, block_size, kernel=""):
    """`steps` decode steps of every row, attending over each row's first `blocks` blocks;
    returns (rows, tokens `[B, steps]`, log-probs, which of them were generated)."""
    config = model.config
    B = rows.lengths_B.shape[0]
    tables_BM = rows.tables_BM[:, :blocks]
    slots_BS = _slots_of(tables_BM, block_size)

    def body(rows: _Rows, _):
        keys_B = jax.vmap(jax.random.fold_in)(rows.keys_B, rows.num_B)
        token_B = _sample_rows(rows, keys_B)
        logprob_B = jnp.take_along_axis(
            jax.nn.log_softmax(rows.logits_BV, axis=-1), token_B[:, None], axis=-1
        )[:, 0]
        live_B = ~rows.done_B
        token_B = jnp.where(live_B, token_B, 0)
        num_B = rows.num_B + live_B
        done_B = rows.done_B | jnp.isin(token_B, eos_E) | (num_B >= rows.budget_B)
        position_B = rows.lengths_B
        slot_B = jnp.take_along_axis(
            slots_BS, jnp.minimum(position_B, slots_BS.shape[1] - 1)[:, None], axis=1
        )[:, 0]
        cache = PagedKVCache(
            rows.k,
            rows.v,
            write_slots_BL=jnp.where(live_B, slot_B, _SCRATCH)[:, None],
            tables_BM=tables_BM,
            lengths_B=position_B + 1,
            dtype=jnp.dtype(config.dtype).name,
            kernel=kernel,
            ring_rows_B=jnp.arange(B, dtype=jnp.int32),
        )
        logits_B1V, cache = model(
            token_B[:, None], position_B[:, None], jnp.ones((B, 1), jnp.int32), cache
        )
        rows = rows._replace(
            k=cache.k_TNbKH,
            v=cache.v_TNbKH,
            lengths_B=rows.lengths_B + live_B,
            logits_BV=logits_B1V[:, 0],
            num_B=num_B,
            done_B=done_B,
        )
        return rows, (token_B, jnp.where(live_B, logprob_B, 0.0), live_B)

    rows, (tokens_KB, logprobs_KB, live_KB) = jax.lax.scan(body, rows, length=steps)
    return rows, tokens_KB.T, logprobs_KB.T, live_KB.T


def empty_rows(
    model_config, config: EngineConfig, num_blocks: int, blocks_per_seq: int, *, combined: bool
) -> _Rows:
    """The engine's device state with no request in it (a pure function: `jax.eval_shape`
    gives its shapes for ahead-of-time compilation)."""
    B = config.slots
    k, v = PagedKVCache.init_pool(
        model_config,
        num_blocks,
        config.block_size,
        config.kv_dtype,
        combined=combined,
        ring_rows=B,
        recent=config.kv_recent,
    )

    def ints():  # separate buffers: the state is donated
        return jnp.zeros((B,), jnp.int32)

    return _Rows(
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
    )


@dataclasses.dataclass
class Request:
    """A prompt and what to generate for it: `n` samples of at most `max_new_tokens` each,
    sample j keyed `fold_in(key, j)`. Filled in as it runs: `tokens`/`logprobs` per sample
    and `done` per sample."""

    prompt: list[int]
    max_new_tokens: int
    key: jax.Array
    n: int = 1
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    tokens: list[list[int]] = dataclasses.field(default_factory=list)
    logprobs: list[list[float]] = dataclasses.field(default_factory=list)
    done: list[bool] = dataclasses.field(default_factory=list)
    admitted: int = 0  # samples placed in rows so far

    def __post_init__(self):
        self.tokens = [[] for _ in range(self.n)]
        self.logprobs = [[] for _ in range(self.n)]
        self.done = [False] * self.n


@dataclasses.dataclass
class EngineStats:
    """Counts since the engine was made: prompt tokens asked for vs prefilled (prefix sharing
    prefills a group's prompt once), tokens generated, device calls, peak blocks in use."""

    prompt_tokens: int = 0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    prefill_calls: int = 0
    decode_calls: int = 0
    peak_blocks: int = 0


class Engine:
    """Continuous-batching generation over a paged KV cache for one model.

    `submit` queues requests, `step` admits what fits, decodes one chunk and returns the
    requests that finished; `run` steps until the queue is empty. The weights are a jit
    argument: `engine.model = new_model` (same shapes) swaps them without recompiling.
    """

    def __init__(
        self,
        model: Transformer,
        config: EngineConfig = EngineConfig(),
        *,
        max_len: int | None = None,
        eos_ids: Sequence[int] = (),
    ):
        self.model, self.config = model, config
        self.max_len = max_len or model.config.max_seq_len
        bs = config.block_size
        self.blocks_per_seq = -(-self.max_len // bs)
        num_blocks = config.num_blocks or 1 + config.slots * self.blocks_per_seq
        if num_blocks < 1 + self.blocks_per_seq:
            raise ValueError(
                f"engine num_blocks={num_blocks} cannot hold one sequence of {self.max_len} "
                f"tokens ({self.blocks_per_seq} blocks of {bs} plus the scratch block); raise "
                f"num_blocks or lower max_len"
            )
        self.num_blocks = num_blocks
        device = next(iter(jax.tree.leaves(model.params)[0].devices()))
        self.kernel = config.kernel(model.config, device.platform)
        self.stats = EngineStats()
        self.set_eos(eos_ids)
        self._free = list(range(num_blocks - 1, 0, -1))  # a stack; block 0 is scratch
        self._refs = np.zeros(num_blocks, np.int32)
        self._queue: collections.deque[Request] = collections.deque()
        self._row_of: list[tuple[Request, int, list[int]] | None] = [None] * config.slots
        self._rows = self._init_rows()

    def _init_rows(self) -> _Rows:
        """Empty rows and pool on the model's devices: replicated, except the pool, whose kv
        heads split over the mesh's tensor axis like the model's (a single-device model puts
        everything on its device)."""
        c = self.config
        rows = empty_rows(
            self.model.config, c, self.num_blocks, self.blocks_per_seq, combined=bool(self.kernel)
        )
        placed = jax.tree.leaves(self.model.params)[0].sharding
        if not isinstance(placed, jax.sharding.NamedSharding):
            return jax.device_put(rows, placed)
        mesh = placed.mesh

        def pool_sharding(x):
            axes = (None, None, None, "act_kv_heads", None)[: x.ndim]
            return jax.sharding.NamedSharding(mesh, logical_to_spec(axes, x.shape, mesh))

        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        shardings = rows._replace(
            **{f: jax.tree.map(lambda _: replicated, getattr(rows, f)) for f in rows._fields},
        )
        shardings = shardings._replace(
            k=jax.tree.map(pool_sharding, rows.k), v=jax.tree.map(pool_sharding, rows.v)
        )
        return jax.device_put(rows, shardings)

    @property
    def blocks_in_use(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    @property
    def idle(self) -> bool:
        return not self._queue and all(r is None for r in self._row_of)

    def submit(self, request: Request) -> Request:
        total = len(request.prompt) + request.max_new_tokens
        if not request.prompt or request.max_new_tokens < 1 or total > self.max_len:
            raise ValueError(
                f"a request of {len(request.prompt)} prompt tokens and max_new_tokens="
                f"{request.max_new_tokens} does not fit the engine (max_len={self.max_len})"
            )
        self._queue.append(request)
        return request

    def run(self) -> None:
        while not self.idle:
            self.step()

    def step(self) -> list[Request]:
        """Admits waiting requests into free rows, decodes one chunk; returns the requests
        whose last sample finished in it."""
        self._admit()
        bs = self.config.block_size
        live = [r for r in self._row_of if r is not None]
        if not live:
            return []
        # No more steps than the longest row has budget for, and attention over as many
        # blocks as it needs by the chunk's end (powers of two, to bound compilations).
        left = max(req.max_new_tokens - len(req.tokens[j]) for req, j, _ in live)
        steps = min(self.config.chunk, 1 << (left - 1).bit_length())
        need = max(
            len(req.prompt) + min(req.max_new_tokens, len(req.tokens[j]) + steps)
            for req, j, _ in live
        )
        blocks = min(self.blocks_per_seq, 1 << (-(-need // bs) - 1).bit_length())
        self._rows, tok_BK, lp_BK, live_BK = _decode(
            self.model,
            self._rows,
            self._eos_E,
            steps=steps,
            blocks=blocks,
            block_size=bs,
            kernel=self.kernel,
        )
        self.stats.decode_calls += 1
        tok_BK, lp_BK, live_BK, done_B = jax.device_get((tok_BK, lp_BK, live_BK, self._rows.done_B))
        finished = []
        for b, entry in enumerate(self._row_of):
            if entry is None:
                continue
            req, j, blocks_of_row = entry
            got = live_BK[b]
            req.tokens[j] += tok_BK[b, got].tolist()
            req.logprobs[j] += lp_BK[b, got].tolist()
            self.stats.generated_tokens += int(got.sum())
            if done_B[b]:
                req.done[j] = True
                self._release(blocks_of_row)
                self._row_of[b] = None
                if all(req.done):
                    finished.append(req)
        return finished

    def set_eos(self, eos_ids: Sequence[int]) -> None:
        """The ids that end a sample, for requests from now on."""
        self._eos = frozenset(int(e) for e in eos_ids)
        self._eos_E = jnp.asarray(sorted(self._eos) or [-1], jnp.int32)

    def hit_eos(self, req: Request, j: int) -> bool:
        """Whether sample j ended on an EOS id (else on its token budget)."""
        return bool(req.tokens[j]) and req.tokens[j][-1] in self._eos

    # -- admission: blocks, prefix sharing ---------------------------------------------------

    def _take(self, count: int) -> list[int]:
        blocks = [self._free.pop() for _ in range(count)]
        self._refs[blocks] = 1
        return blocks

    def _release(self, blocks: list[int]) -> None:
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def _admit(self) -> None:
        c, bs = self.config, self.config.block_size
        free_rows = [b for b, r in enumerate(self._row_of) if r is None]
        prefill, starts, copies = [], [], []
        while self._queue and free_rows:
            req = self._queue[0]
            P = len(req.prompt)
            full, tail = divmod(P, bs)
            per_sample = -(-(P + req.max_new_tokens) // bs)
            share = c.prefix_sharing and req.n > 1
            k = min(req.n - req.admitted, len(free_rows))
            # Blocks: the first sample's whole table; each other sample its own beyond the
            # shared full prompt blocks.
            need = per_sample + (k - 1) * (per_sample - full) if share else k * per_sample
            if need > len(self._free):
                # Fewer samples if that fits, else wait for running rows to free blocks.
                while k > 1 and need > len(self._free):
                    k -= 1
                    need = per_sample + (k - 1) * (per_sample - full) if share else k * per_sample
                if need > len(self._free):
                    break
            for i in range(k):
                if i == 0 or not share:
                    table = leader = self._take(per_sample)
                    group = len(prefill)
                    prefill.append((req, table))
                else:
                    self._refs[leader[:full]] += 1
                    own = self._take(per_sample - full)
                    table = leader[:full] + own
                    if tail:
                        copies.append((leader[full], own[0]))
                starts.append((free_rows.pop(0), req, req.admitted + i, table, group))
            req.admitted += k
            if req.admitted == req.n:
                self._queue.popleft()
        if prefill:
            self._launch(prefill, starts, copies)

    def _launch(self, prefill, starts, copies) -> None:
        c, bs = self.config, self.config.block_size
        G = 1 << (len(prefill) - 1).bit_length()
        P = c.prefill_bucket * -(-max(len(r.prompt) for r, _ in prefill) // c.prefill_bucket)
        R = -(-P // bs)
        tokens = np.zeros((G, P), np.int32)
        lengths = np.ones(G, np.int32)
        tables = np.zeros((G, R), np.int32)
        for g, (req, table) in enumerate(prefill):
            tokens[g, : len(req.prompt)] = req.prompt
            lengths[g] = len(req.prompt)
            head = table[:R]
            tables[g, : len(head)] = head
            self.stats.prefill_tokens += len(req.prompt)
        self.stats.prompt_tokens += sum(len(req.prompt) for _, req, *_ in starts)
        # A layered pool's ring row of each prompt: its first sample's row (padding: scratch).
        ring_rows = np.full(G, c.slots, np.int32)
        for row, _, _, _, group in reversed(starts):
            ring_rows[group] = row
        # Rows and copies are padded to `slots` (one compilation per prompt count and length).
        padded = starts + starts[-1:] * (c.slots - len(starts))
        row_tables = np.zeros((c.slots, self.blocks_per_seq), np.int32)
        for x, (_, _, _, table, _) in enumerate(padded):
            row_tables[x, : len(table)] = table
        copies = copies or [(_SCRATCH, _SCRATCH)]
        copies += copies[-1:] * (c.slots - len(copies))
        self._rows = _prefill(
            self.model,
            self._rows,
            jnp.asarray(tokens),
            jnp.asarray(lengths),
            jnp.asarray(tables),
            jnp.asarray(ring_rows),
            jnp.asarray([a for a, _ in copies], jnp.int32),
            jnp.asarray([b for _, b in copies], jnp.int32),
            jnp.asarray([s[0] for s in padded], jnp.int32),
            jnp.asarray([s[4] for s in padded], jnp.int32),
            jnp.asarray(row_tables),
            jnp.asarray([s[1].max_new_tokens for s in padded], jnp.int32),
            jax.vmap(jax.random.fold_in)(
                jnp.stack([s[1].key for s in padded]), jnp.asarray([s[2] for s in padded])
            ),
            jnp.asarray([s[1].temperature for s in padded], jnp.float32),
            jnp.asarray([s[1].top_k for s in padded], jnp.int32),
            jnp.asarray([s[1].top_p for s in padded], jnp.float32),
            block_size=bs,
        )
        self.stats.prefill_calls += 1
        for row, req, j, table, _ in starts:
            self._row_of[row] = (req, j, table)
        self.stats.peak_blocks = max(self.stats.peak_blocks, self.blocks_in_use)

    # -- cancelling: a client went away, a stop string was hit --------------------------------

    def cancel(self, request: Request, sample: int | None = None) -> bool:
        """Ends sample `sample` of `request` (every sample when None) where it stands.

        A queued request leaves the queue; a running sample's row and blocks are free for the
        next `step` (its row writes to the scratch block until a new request takes it). Tokens
        generated so far stay in `request`. A single sample must be running or done, not still
        queued. Returns whether every sample of `request` is now done.
        """
        if sample is None:
            samples = range(request.n)
            self._queue = collections.deque(r for r in self._queue if r is not request)
        elif not 0 <= sample < request.admitted:
            raise ValueError(
                f"sample {sample} of the request is not running (admitted: {request.admitted} "
                f"of {request.n}); cancel the whole request instead"
            )
        else:
            samples = (sample,)
        ended = []
        for b, entry in enumerate(self._row_of):
            if entry is not None and entry[0] is request and entry[1] in samples:
                self._release(entry[2])
                self._row_of[b] = None
                ended.append(b)
        if ended:
            done_B = self._rows.done_B.at[jnp.asarray(ended, jnp.int32)].set(True)
            self._rows = self._rows._replace(done_B=done_B)
        for j in samples:
            request.done[j] = True
        return all(request.done)
