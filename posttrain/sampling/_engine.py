"""The generation engine: a paged KV cache, continuous batching and prefix sharing.

Requests wait in a queue; `slots` rows decode together, and a row whose sample ends takes the
next request between jitted chunks of `chunk` decode steps, so one long answer does not idle
the batch. Keys and values live in a pool of fixed-size blocks: a request is admitted when the
pool has the blocks its prompt and token budget need, and gives them back when it ends.

The n samples of a prompt (a GRPO group) share its blocks: the prompt is prefilled once into
the first sample's blocks; the others point their block tables at its full blocks and copy the
last, partly filled one (an MTP drafter's cache runs a position behind, so the block holding
the prompt's last token is always copied). Reference counts free a block with its last user.
A group admitted in parts (fewer free rows than samples) keeps its prompt's full blocks and a
copy of the last one for the samples left waiting, which pass only the prompt's last token
over them (`keeps_kv` says where that applies).

Sampling is keyed per request: sample j of prompt i draws its k-th token with
`fold_in(fold_in(key_i, j), k)`, where `key_i` is the prompt's own seed (`seeds`) or
`fold_in(key(seed), i)`; so outputs do not depend on the slot, the chunk or what else runs, and
`generate` keys the same way (and the tests' padded reference loop too).

With a drafter (`PromptLookup`, `DraftModel` or `MTP`) every chunk is rounds of speculative
decoding (`_rounds.speculate`): a row emits 1 to k+1 tokens per model forward, greedy output is
the plain engine's, sampling keeps the model's distribution. A request reserves k slots past
its prompt and budget; a draft model (or MTP module) keeps its own pool on the same blocks and
tables, so prefix sharing and block accounting cover it. The device functions are in `_paged`;
this is the host side (admission, block tables, counts).

The host queues a fixed number of device programs per engine call (a prefill, a decode chunk),
whatever the number of requests: their arguments are host arrays, requests may bring their
keys as host data, and the results come back in one transfer. XLA:CPU holds at most 32
programs queued per device; past that a launch waits on a thread the other queued programs
may need, and with a program spanning processes (or devices) in the queue the run deadlocks
(docs/multihost.md)."""

from __future__ import annotations

import collections
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.models import Transformer
from posttrain.parallel import fetch
from posttrain.sampling._blocks import BlockPool
from posttrain.sampling._engine_config import EngineConfig, EngineStats
from posttrain.sampling._paged import Rows, decode, empty_rows, on_devices_of, prefill
from posttrain.sampling._prefill_inputs import prefill_images, prefill_inputs
from posttrain.sampling._request import Kept, Request
from posttrain.sampling._rounds import speculate
from posttrain.sampling._speculative import (
    MTP,
    DraftModel,
    PromptLookup,
    draft_config,
    drafter_lookahead,
)


class Engine:
    """Continuous-batching generation over a paged KV cache for one model.

    `submit` queues requests, `step` admits what fits, decodes one chunk and returns the
    requests that finished; `run` steps until the queue is empty. The weights are a jit
    argument: `engine.model = new_model` (same shapes) swaps them without recompiling, also
    mid-request (running ones continue with their KV; `version` labels what each decoded);
    `engine.drafter = DraftModel(new_draft, k)` likewise.

    `drafter`: decode speculatively with prompt lookup, a draft model (same vocabulary) or
    the model's MTP module; not with the layered int8 cache, whose ring of recent tokens a
    round's drafts would overwrite.
    """

    def __init__(
        self,
        model: Transformer,
        config: EngineConfig = EngineConfig(),  # noqa: B008 (a frozen record)
        *,
        max_len: int | None = None,
        eos_ids: Sequence[int] = (),
        drafter: PromptLookup | DraftModel | MTP | None = None,
    ):
        if model.config.nnx is not None and (
            drafter or config.speculative or config.kv_dtype != "auto"
        ):
            raise ValueError(
                f"{model.config.nnx.builder} is a Flax NNX module: the engine decodes it by "
                "rerunning it over each row's tokens, with no KV cache to quantise or draft "
                "into; use kv_dtype='auto' and no speculative decoding"
            )
        if config.slots < 1:
            raise ValueError(
                "engine slots must be >= 1 in an engine (slots=0 in a config means 'sized to "
                "the work': give the engine its row count with EngineConfig.sized(rows))"
            )
        if drafter is None and config.speculative:
            drafter = PromptLookup(k=config.speculative)
        if not all(isinstance(x, jax.Array) for x in jax.tree.leaves(model.params)):
            model = jax.device_put(model)  # host weights (NumPy): onto the default device
        self.model, self.config = model, config
        self.drafter = drafter
        self.version = 0  # of the weights (RL's partial rollouts swap them mid-request)
        self.max_len = max_len or model.config.max_seq_len
        self._ahead = drafter_lookahead(drafter, model, config.kv_dtype)
        if config.record_routes and (model.config.moe is None or drafter is not None):
            raise ValueError(
                "engine record_routes needs a MoE model and no drafter (router replay records "
                "each position's experts); turn it off or drop the drafter"
            )
        bs = config.block_size
        self.blocks_per_seq = -(-(self.max_len + self._ahead) // bs)
        num_blocks = config.num_blocks or 1 + config.slots * self.blocks_per_seq
        if num_blocks < 1 + self.blocks_per_seq:
            raise ValueError(
                f"engine num_blocks={num_blocks} cannot hold one sequence of {self.max_len} "
                f"tokens ({self.blocks_per_seq} blocks of {bs} plus the scratch block); raise "
                f"num_blocks or lower max_len"
            )
        self.num_blocks = num_blocks
        devices = jax.tree.leaves(model.params)[0].sharding.device_set
        platform = next(iter(devices)).platform
        nnx = model.config.nnx is not None
        self.kernel = "" if nnx else config.kernel(model.config, platform, len(devices))
        self.stats = EngineStats()
        self.set_eos(eos_ids)
        self._blocks = BlockPool(num_blocks)
        self._queue: collections.deque[Request] = collections.deque()
        self._row_of: list[tuple[Request, int, list[int]] | None] = [None] * config.slots
        self._rows = self._init_rows()

    def _init_rows(self) -> Rows:
        """Empty rows and pool on the model's devices (`on_devices_of`)."""
        c, drafter = self.config, self.drafter
        rows = empty_rows(
            self.model.config,
            c,
            self.num_blocks,
            self.blocks_per_seq,
            combined=bool(self.kernel),
            history=self.blocks_per_seq * c.block_size
            if drafter or self.model.config.nnx is not None
            else 1,
            draft_config=draft_config(drafter),
            mtp=isinstance(drafter, MTP),
        )
        return on_devices_of(rows, self.model.params)

    @property
    def model(self) -> Transformer:
        return self._model

    @model.setter
    def model(self, model: Transformer) -> None:
        """New weights (same shapes): the prefix cache's blocks hold the old ones' keys."""
        self._model = model
        if getattr(self, "_blocks", None) is not None:  # (not while __init__ sets the first)
            self.clear_prefix_cache()

    def clear_prefix_cache(self) -> None:
        """Drops every cached prompt block (running sequences keep theirs)."""
        self._blocks.clear_cache()

    @property
    def blocks_in_use(self) -> int:
        """Blocks sequences hold (not those only the prefix cache keeps)."""
        return self.num_blocks - 1 - len(self._blocks.free) - self._blocks.evictable()

    @property
    def blocks_cached(self) -> int:
        """Blocks the prefix cache keeps."""
        return len(self._blocks.cache)

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
        if request.cached is not None and not request.cached.blocks:  # (dropped: prefill all)
            request.cached = None
        cached = request.cached
        if cached is not None and (request.n != 1 or not 0 < cached.length <= total - 1):
            raise ValueError(
                f"a request continuing {cached.length} cached tokens must be one sample whose "
                f"prompt ({len(request.prompt)} tokens) extends them"
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
        per_step = 1 + self._ahead  # most tokens a row emits per step (round)
        need = self._ahead + max(
            len(req.prompt) + min(req.max_new_tokens, len(req.tokens[j]) + steps * per_step)
            for req, j, _ in live
        )
        blocks = min(self.blocks_per_seq, 1 << (-(-need // bs) - 1).bit_length())
        if self.drafter is None:
            self._rows, tok_BK, lp_BK, live_BK = decode(
                self.model,
                self._rows,
                self._eos_E,
                steps=steps,
                blocks=blocks,
                block_size=bs,
                kernel=self.kernel,
                unstack=self.config.unstack_layers,
            )
        else:
            self._rows, tok_BK, lp_BK, live_BK, counts = speculate(
                self.model,
                self.drafter,
                self._rows,
                self._eos_E,
                rounds=steps,
                blocks=blocks,
                block_size=bs,
                greedy=all(req.sampling.greedy for req, _, _ in live),
                unstack=self.config.unstack_layers,
            )
            proposed, accepted, rounds = (int(x) for x in fetch(counts))
            self.stats.proposed += proposed
            self.stats.accepted += accepted
            self.stats.rounds += rounds
        self.stats.decode_calls += 1
        tok_BK, lp_BK, live_BK, done_B, cached_B = fetch(
            (tok_BK, lp_BK, live_BK, self._rows.done_B, self._rows.lengths_B)
        )
        finished, ended = [], []
        for b, entry in enumerate(self._row_of):
            if entry is None:
                continue
            req, j, blocks_of_row = entry
            got = live_BK[b]
            req.tokens[j] += tok_BK[b, got].tolist()
            req.logprobs[j] += lp_BK[b, got].tolist()
            req.versions[j] += [self.version] * int(got.sum())
            self.stats.generated_tokens += int(got.sum())
            if done_B[b]:
                req.done[j] = True
                ended.append((b, req, j))
                if req.keep and self.keeps_kv(req):  # the blocks its tokens are in stay
                    used = -(-int(cached_B[b]) // self.config.block_size)
                    req.kept[j] = self._blocks.keep(blocks_of_row[:used], int(cached_B[b]))
                    blocks_of_row = blocks_of_row[used:]
                self._blocks.release(blocks_of_row)
                self._row_of[b] = None
                if all(req.done):
                    finished.append(req)
        if ended and self._rows.routes_BSTK is not None:
            routes = fetch(self._rows.routes_BSTK[np.asarray([b for b, _, _ in ended])])
            for (_, req, j), routes_STK in zip(ended, routes, strict=True):
                req.routes[j] = routes_STK[: len(req.prompt) + len(req.tokens[j])]
        return finished

    def set_eos(self, eos_ids: Sequence[int]) -> None:
        """The ids that end a sample, for requests from now on."""
        self._eos = frozenset(int(e) for e in eos_ids)
        self._eos_E = jnp.asarray(sorted(self._eos) or [-1], jnp.int32)

    def hit_eos(self, req: Request, j: int) -> bool:
        """Whether sample j ended on an EOS id (else on its token budget)."""
        return bool(req.tokens[j]) and req.tokens[j][-1] in self._eos

    # -- admission: blocks, prefix sharing ---------------------------------------------------

    def keeps_kv(self, req: Request | None = None) -> bool:
        """Whether a sample's KV blocks can outlive it (`Request.keep`, `Request.cached`) or a
        group admitted in parts can share its prefill: where only keys and values hold the
        sequence. Not with a layered int8 pool (its ring), a draft model's or MTP module's pool,
        router replay's routes, a VLM's images (`req`'s) or an NNX module (no pool)."""
        c = self.config
        return not (
            c.kv_dtype == "int8_layered"
            or isinstance(self.drafter, DraftModel | MTP)
            or self._rows.routes_BSTK is not None
            or (req is not None and req.images is not None)
            or self.model.config.nnx is not None
        )

    def release(self, kept: Kept | None) -> None:
        """Gives back the blocks a finished sample kept (`Request.keep`), unless passed on."""
        if kept is not None:
            self._blocks.drop(kept)

    def _admit(self) -> None:
        c, bs = self.config, self.config.block_size
        free_rows = [b for b, r in enumerate(self._row_of) if r is None]
        leaders, starts, copies, pre = [], [], [], []
        while self._queue and free_rows:
            req = self._queue[0]
            P = len(req.prompt)
            full, tail = divmod(P, bs)
            if isinstance(self.drafter, MTP):  # it writes position P - 1 in the first round
                full, tail = (P - 1) // bs, 1
            per_sample = -(-(P + req.max_new_tokens + self._ahead) // bs)
            share = c.prefix_sharing and req.n > 1
            held = self._blocks.held.get(id(req))  # its prompt's blocks, from its first admission
            k = min(req.n - req.admitted, len(free_rows))
            if req.cached is not None and not req.cached.blocks:  # dropped: prefill it all
                req.cached = None
            fresh = not held and req.cached is None
            can_hold = share and fresh and self.keeps_kv(req)
            keys, found = [], []  # its full blocks' keys; those the prefix cache holds
            if c.prefix_cache and fresh and self.keeps_kv(req):
                keys, found = self._blocks.cached_prefix(req.prompt, bs)
            # Blocks: a prefilled group's first sample takes its whole table past what the
            # prefix cache has (and a copy of its last prompt block if it holds the prompt for
            # samples left waiting); every other sample its own beyond the shared full prompt
            # blocks; a continued sequence what its kept blocks lack. Fewer samples if that
            # fits, else wait for running rows to free blocks (or evict cached ones).
            first = per_sample - (
                full if held else len(req.cached.blocks) if req.cached else len(found)
            )
            other = per_sample - full if share else per_sample - len(found)
            pool = self._blocks
            available = len(pool.free) + pool.evictable(keep=found) + pool.droppable(req.cached)
            while True:
                keeps_tail = can_hold and tail > 0 and req.admitted + k < req.n
                need = first + (k - 1) * other + int(keeps_tail)
                if need <= available or k == 1:
                    break
                k -= 1
            if need > available:
                break
            if req.cached is not None:  # a sequence's next part: its kept blocks, and more
                cached = req.cached
                self._blocks.kept.pop(id(cached), None)  # (the row's now: not dropped to make room)
                table = cached.blocks + self._blocks.take(first)
                # Its tokens past the cached ones (at least its last, for the logits).
                leaders.append((req, table, min(cached.length, P - 1), cached.length))
                starts.append((free_rows.pop(0), req, 0, table, len(leaders) - 1))
                req.cached = None  # (the blocks are the row's now)
            elif held:  # later samples: over the held prompt blocks, their own last one
                shared, snapshot = held
                for i in range(k):
                    self._blocks.refs[shared] += 1
                    own = self._blocks.take(per_sample - full)
                    table = shared + own
                    if i == 0:
                        leader, group = table, len(leaders)
                        leaders.append((req, table, P - 1, P))  # its last token: the logits
                        if snapshot is not None:
                            pre.append((snapshot, own[0]))
                    elif tail:
                        copies.append((leader[full], own[0]))
                    starts.append((free_rows.pop(0), req, req.admitted + i, table, group))
            else:
                for i in range(k):
                    if i == 0 or not share:
                        self._blocks.refs[found] += 1
                        table = leader = found + self._blocks.take(per_sample - len(found))
                        group = len(leaders)
                        # Its tokens past the cached blocks (at least its last: the logits).
                        done = len(found) * bs
                        leaders.append((req, table, min(done, P - 1), done))
                        self.stats.cached_tokens += min(done, P - 1)
                        # Its full blocks are the cache's from now: a prompt admitted after it in
                        # this round reads them in the same prefill call (each layer writes
                        # every prompt's keys before any reads them).
                        self._blocks.cache_blocks(
                            keys[len(found) :], leader[len(found) : len(keys)]
                        )
                    else:
                        self._blocks.refs[leader[:full]] += 1
                        own = self._blocks.take(per_sample - full)
                        table = leader[:full] + own
                        if tail:
                            copies.append((leader[full], own[0]))
                    starts.append((free_rows.pop(0), req, req.admitted + i, table, group))
                if can_hold and req.admitted + k < req.n:  # its blocks wait for the samples left
                    self._blocks.refs[leader[:full]] += 1
                    snapshot = None
                    if tail:
                        [snapshot] = self._blocks.take(1)
                        copies.append((leader[full], snapshot))
                    self._blocks.held[id(req)] = (leader[:full], snapshot)
            req.admitted += k
            if req.admitted == req.n:
                self._queue.popleft()
                self._blocks.let_go(id(req))
        if leaders:
            self._launch(leaders, starts, copies, pre)

    def _launch(self, leaders, starts, copies, pre) -> None:
        """Runs an admission round's prefill (`_prefill_inputs`) and starts its rows."""
        c = self.config
        inputs = prefill_inputs(
            leaders, starts, copies, pre, slots=c.slots, block_size=c.block_size,
            bucket=c.prefill_bucket, blocks_per_seq=self.blocks_per_seq,
            history=self._rows.history_BT.shape[1],
        )  # fmt: skip
        images = prefill_images(
            self.model.config, self.drafter, [r for r, *_ in leaders], len(inputs[0])
        )
        self.stats.prefill_tokens += sum(len(r.prompt) - start for r, _, start, _ in leaders)
        self.stats.prompt_tokens += sum(len(req.prompt) for _, req, *_ in starts)
        # Host arrays: the jitted prefill takes them in its one call (a jnp call per argument
        # would queue a device program each; see the module docstring).
        drafter = None if isinstance(self.drafter, PromptLookup) else self.drafter
        self._rows = prefill(
            self.model, drafter, self._rows, *inputs, images, block_size=c.block_size
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
            self._blocks.let_go(id(request))
            self.release(request.cached)  # (queued: the blocks it would have continued)
            request.cached = None
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
                self._blocks.release(entry[2])
                self._row_of[b] = None
                ended.append(b)
        if ended:
            done_B = self._rows.done_B.at[jnp.asarray(ended, jnp.int32)].set(True)
            self._rows = self._rows._replace(done_B=done_B)
        for j in samples:
            request.done[j] = True
        return all(request.done)
