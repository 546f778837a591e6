"""The serving backend: one worker thread owns one `Engine` and loops (take new requests,
`step`, hand each request the tokens it gained), so requests from every HTTP client decode
together in the engine's rows, and a row freed by a finished answer takes the next waiting one.
Each prompt of an HTTP request is one engine `Request`; its handler awaits its tokens on its own
asyncio queue, so the event loop never waits on the device. Stop strings are checked on the host
after each engine step: a sample that hit one (or whose client went away) is cancelled, freeing
its row. The HTTP layer (`_serve`) only parses, checks and formats.
"""

import asyncio
import collections
import contextlib
import dataclasses
import queue
import threading
import time
import traceback
from collections.abc import AsyncIterator, Sequence
from typing import NamedTuple

import jax
import numpy as np

from posttrain.models import Transformer
from posttrain.sampling._completion import Completion, _finish
from posttrain.sampling._engine import Engine, Request
from posttrain.sampling._engine_config import EngineConfig
from posttrain.sampling._params import SamplingParams
from posttrain.sampling._speculative import drafter_for


class EngineFailed(Exception):
    """An engine step failed; the message is the error (the server answers HTTP 500)."""


# tokens_per_second counts the tokens generated over this many seconds.
_RATE_WINDOW_S = 10.0


class _Compilations:
    """XLA compilations in this process since the first backend (jax.monitoring's event):
    the engine compiles a program per prefill and decode bucket it meets, so a count that
    keeps rising under a steady load is a shape leak."""

    count = 0
    _listening = False

    @classmethod
    def listen(cls) -> None:
        if not cls._listening:
            cls._listening = True
            jax.monitoring.register_event_duration_secs_listener(cls._heard)

    @classmethod
    def _heard(cls, event: str, duration: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            cls.count += 1


# How each preset sets the engine (see docs/generation.md, "Serving").
PRESETS = {
    # 64 rows decode together, 16 steps per device call: the most tokens per second; a new
    # request waits up to one 16-step call for its prefill. Prompts pad to 64-token buckets.
    "throughput": EngineConfig(slots=64, chunk=16, prefill_bucket=64, prefix_cache=True),
    # 8 rows, 4 rounds per call, speculative decoding with prompt lookup (4 drafts a round): a
    # new request starts (and streams its first tokens) within a few steps, and text that
    # repeats its context comes out several tokens per forward; a lower total throughput.
    # Prompts pad to 16-token buckets.
    "latency": EngineConfig(slots=8, chunk=4, prefill_bucket=16, speculative=4, prefix_cache=True),
}


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """What the server runs with; `ServeConfig.from_preset` takes the engine from a preset.

    `engine`: the engine's settings (`EngineConfig`): rows decoded together (more requests wait
    for a free row), decode steps per device call (requests join and leave between calls),
    the prefill bucket, the KV pool (`num_blocks` 0 gives every row room for a max_seq_len
    sequence: small for small models, set it for long-context ones) and its dtype, and
    prompt-lookup drafts per speculative round (greedy answers are the same either way; seeded
    samples are reproducible, but other draws than plain decoding's).
    """

    model_name: str = "posttrain"  # the id /v1/models lists and requests name
    preset: str = "throughput"  # the PRESETS entry the engine came from
    engine: EngineConfig = PRESETS["throughput"]
    # Admission (docs/generation.md, "Limits"): one request's n x prompts; more is HTTP 400.
    max_request_samples: int = 64
    # Sequences (n x prompts, summed over requests) in flight or waiting; more get HTTP 429.
    # 0: four times the engine's rows.
    max_sequences: int = 0
    # KV tokens (each prompt + n x max_tokens) in flight or waiting; more get HTTP 429, one
    # request over it HTTP 400. 0: four times the KV pool's tokens.
    max_queue_tokens: int = 0
    default_max_tokens: int = 256  # max_tokens of a request that gives none (cut to fit)
    max_body_bytes: int = 8 * 2**20  # a larger request body is refused (HTTP 413) unread
    # Requests to /v1/* need `Authorization: Bearer <api_key>` when set (compared in constant
    # time); /health and /metrics stay open.
    api_key: str = dataclasses.field(default="", repr=False)
    drain_s: int = 5  # on SIGTERM or Ctrl-C: seconds answers in flight get, then they are cut

    @classmethod
    def from_preset(cls, preset: str, engine: dict | None = None, **overrides) -> "ServeConfig":
        """The config of a PRESETS entry, its engine's fields replaced by `engine` and the
        server's by `overrides`."""
        if preset not in PRESETS:
            raise ValueError(f"unknown serve preset {preset!r}; choose one of {sorted(PRESETS)}")
        return cls(
            preset=preset, engine=dataclasses.replace(PRESETS[preset], **engine or {}), **overrides
        )


@dataclasses.dataclass(frozen=True)
class Settings:
    """One request's sampling settings, checked (see `check_settings`)."""

    max_tokens: int
    sampling: SamplingParams
    n: int
    seed: int  # prompt i's samples draw from seed + i (mod 2**32), as `generate(seeds=...)`
    stop: tuple[str, ...]


class Piece(NamedTuple):
    """A streamed piece: new text, tokens generated so far, and on the last piece only, the
    finish reason ("stop" or "length")."""

    text: str
    num_tokens: int
    finish_reason: str | None


class _Update(NamedTuple):
    """What the worker hands a handler after an engine step: each sample's new tokens (streamed
    requests only) and whether every sample is done."""

    tokens: list[list[int]]
    finished: bool


@dataclasses.dataclass(eq=False)
class _Track:
    """One prompt of an HTTP request: its engine request (made by the worker) and the queue on
    the handler's event loop its updates (or a failure message) go to."""

    prompt: list[int]
    settings: Settings
    seed: int
    streaming: bool
    loop: asyncio.AbstractEventLoop
    updates: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    request: Request | None = None
    sent: list[int] = dataclasses.field(default_factory=list)  # tokens per sample seen so far
    finished: bool = False  # the handler got the last update

    async def next(self) -> _Update:
        """The next update; `EngineFailed` if the engine failed."""
        update = await self.updates.get()
        if isinstance(update, str):
            raise EngineFailed(update)
        self.finished = update.finished
        return update


class _Backend:
    """The server's engine, owned by a worker thread that decodes every handler's requests
    together; handlers `complete` or `stream` from the event loop."""

    def __init__(
        self, model: Transformer, tokenizer, config: ServeConfig, *, mesh=None, mtp=None, max_len=0
    ):
        """`max_len`: tokens per sequence (prompt and completion); 0: the model's max_seq_len."""
        self.tokenizer = tokenizer
        self.max_seq_len = max_len or model.config.max_seq_len
        self._model, self._config, self._mesh, self._mtp = model, config, mesh, mtp
        self._eos = frozenset(tokenizer.eos_ids)
        _Compilations.listen()
        with self._on_mesh():
            self.engine = self._new_engine()
        # Tokens the KV pool holds (its first block is the null block).
        self.kv_tokens = (self.engine.num_blocks - 1) * self.engine.config.block_size
        self._counts = collections.deque([(time.monotonic(), 0)])  # (time, tokens generated)
        self._counts_lock = threading.Lock()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # ("submit" | "cancel", track)
        self._active: list[_Track] = []  # submitted and not finished; the worker's alone
        self._worker = threading.Thread(target=self._work, name="posttrain-engine", daemon=True)
        self._worker.start()

    def _on_mesh(self):
        return jax.set_mesh(self._mesh) if self._mesh is not None else contextlib.nullcontext()

    def _new_engine(self) -> Engine:
        c = self._config
        drafter = drafter_for(c.engine.speculative, self._mtp)
        return Engine(self._model, c.engine, max_len=self.max_seq_len,
                      eos_ids=self.tokenizer.eos_ids, drafter=drafter)  # fmt: skip

    def close(self) -> None:
        """Stops the worker (after its current step)."""
        self._inbox.put(("close", None))
        self._worker.join()

    def stats(self) -> dict:
        """The engine's settings, its counters since start (`EngineStats`) and what it holds."""
        engine = self.engine
        return {"preset": self._config.preset, "slots": engine.config.slots,
                "chunk": engine.config.chunk, "num_blocks": engine.num_blocks,
                "speculative": engine.config.speculative,
                "drafter": type(self.engine.drafter).__name__ if self.engine.drafter else None,
                "blocks_in_use": engine.blocks_in_use, "blocks_cached": engine.blocks_cached,
                "requests": len(self._active),
                "tokens_per_second": self._tokens_per_second(),
                "compilations": _Compilations.count,
                **dataclasses.asdict(engine.stats)}  # fmt: skip

    def _tokens_per_second(self) -> float:
        """Tokens generated over the last `_RATE_WINDOW_S` seconds (or since start), per second."""
        now = time.monotonic()
        with self._counts_lock:
            counts = list(self._counts)
        start = max(now - _RATE_WINDOW_S, counts[0][0])
        before = [n for t, n in counts if t <= start] or [counts[0][1]]
        return (counts[-1][1] - before[-1]) / max(now - start, 1e-3)

    def _count_tokens(self) -> None:
        """Records the tokens generated so far (the worker, after each step), keeping the
        last sample before the window."""
        now = time.monotonic()
        with self._counts_lock:
            self._counts.append((now, self.engine.stats.generated_tokens))
            while len(self._counts) > 2 and self._counts[1][0] <= now - _RATE_WINDOW_S:
                self._counts.popleft()

    # -- the handlers' side (event loop) ---------------------------------------------------

    def _submit(self, prompt: list[int], settings: Settings, i: int, *, streaming: bool):
        seed = (settings.seed + i) % 2**32
        track = _Track(prompt, settings, seed, streaming, asyncio.get_running_loop())
        self._inbox.put(("submit", track))
        return track

    def _cancel(self, tracks: Sequence[_Track]) -> None:
        for track in tracks:
            if not track.finished:
                self._inbox.put(("cancel", track))

    async def complete(
        self, prompts: list[list[int]], settings: Settings
    ) -> list[list[Completion]]:
        """Per prompt, its `settings.n` completions; prompt i draws from seed + i."""
        tracks = [self._submit(p, settings, i, streaming=False) for i, p in enumerate(prompts)]
        try:
            for track in tracks:
                while not (await track.next()).finished:
                    pass
        finally:
            self._cancel(tracks)  # the handler failed or was cancelled
        return [[self._completion(t.request, j, settings.stop) for j in range(settings.n)]
                for t in tracks]  # fmt: skip

    def _completion(self, req: Request, j: int, stop: tuple[str, ...]) -> Completion:
        hit_eos = bool(req.tokens[j]) and req.tokens[j][-1] in self._eos
        return _finish(self.tokenizer, req.tokens[j], req.logprobs[j], hit_eos, stop)

    async def stream(self, prompt: list[int], settings: Settings) -> AsyncIterator[Piece]:
        """The one completion of `prompt` piece by piece (a piece per engine step): the tokens
        and text `complete` gives it, with text held back while it may begin a stop string."""
        track = self._submit(prompt, settings, 0, streaming=True)
        ids, sent, stop = [], 0, settings.stop
        try:
            while not track.finished:
                text = None
                for token in (await track.next()).tokens[0]:
                    ids.append(token)
                    if token in self._eos:
                        break
                    text = self.tokenizer.decode(ids)
                    if (cut := _first(text, stop)) >= 0:
                        yield Piece(text[sent:cut], len(ids), "stop")
                        return
                # Wait for the rest of a multi-byte character; hold back a stop string's start.
                if text is None or text.endswith("\ufffd"):
                    continue
                ready = len(text) - _partial(text, stop)
                if ready > sent:
                    yield Piece(text[sent:ready], len(ids), None)
                    sent = ready
        finally:
            self._cancel([track])  # a stop string, or the client went away
        finish = "stop" if ids and ids[-1] in self._eos else "length"
        yield Piece(self.tokenizer.decode(ids)[sent:], len(ids), finish)

    # -- the worker's side -----------------------------------------------------------------

    def _work(self) -> None:
        """Until `close`: take new requests and cancellations, step the engine, hand out tokens.
        A failure fails the requests in the engine (HTTP 500) and starts a fresh engine."""
        with self._on_mesh():
            while True:
                messages = [self._inbox.get()] if not self._active else []
                with contextlib.suppress(queue.Empty):
                    while True:
                        messages.append(self._inbox.get_nowait())
                for kind, track in messages:
                    if kind == "close":
                        for waiting in self._active:
                            self._push(waiting, "the server stopped before the answer ended")
                        return
                    try:
                        self._take(kind, track)
                    except Exception as e:  # noqa: BLE001 -- reported to the requests it hits
                        self._fail(e, [track])
                try:
                    if not self.engine.idle:
                        self.engine.step()
                        self._count_tokens()
                    self._publish()
                except Exception as e:  # noqa: BLE001
                    self._fail(e, [])

    def _take(self, kind: str, track: _Track) -> None:
        if kind == "cancel":
            if track in self._active:
                self.engine.cancel(track.request)
            return
        s = track.settings
        track.request = Request(
            prompt=track.prompt, max_new_tokens=s.max_tokens,
            key=jax.random.key(np.uint32(track.seed)), n=s.n, sampling=s.sampling,
        )  # fmt: skip
        track.sent = [0] * s.n
        try:
            self.engine.submit(track.request)
        except ValueError as e:  # the HTTP layer checks lengths: not the client's fault
            self._push(track, f"the engine refused the request: {e}")
            return
        self._active.append(track)

    def _publish(self) -> None:
        """Cancels samples that hit a stop string; hands each request its new tokens (streamed
        ones) or its end."""
        active = []
        for track in self._active:
            req = track.request
            stop = track.settings.stop
            for j, tokens in enumerate(req.tokens):
                new = len(tokens) > track.sent[j]
                if new and stop and not req.done[j]:
                    if _first(self.tokenizer.decode(tokens), stop) >= 0:
                        self.engine.cancel(req, j)
            finished = all(req.done)
            if track.streaming or finished:
                update = _Update(
                    [t[s:] for t, s in zip(req.tokens, track.sent, strict=True)], finished
                )
                if finished or any(update.tokens):
                    self._push(track, update)
            track.sent = [len(t) for t in req.tokens]
            if not finished:
                active.append(track)
        self._active = active

    def _push(self, track: _Track, item: "_Update | str") -> None:
        with contextlib.suppress(RuntimeError):  # the handler's loop closed: nobody waits
            track.loop.call_soon_threadsafe(track.updates.put_nowait, item)

    def _fail(self, error: Exception, tracks: list[_Track]) -> None:
        """Fails `tracks` and every request in the engine, and starts a fresh engine."""
        traceback.print_exc()
        failed = [*self._active, *(t for t in tracks if t not in self._active)]
        self._active = []
        try:  # the engine's state may be half-updated (its rows donated): start over
            stats = self.engine.stats
            self.engine = self._new_engine()
            self.engine.stats = stats
        except Exception:  # noqa: BLE001 -- the next requests fail with their own message
            traceback.print_exc()
        message = f"generation failed ({type(error).__name__}: {error}); please retry"
        for track in failed:
            self._push(track, message)


def _first(text: str, markers: Sequence[str]) -> int:
    """Where the first of `markers` starts in `text`, or -1."""
    return min((i for i in (text.find(m) for m in markers) if i >= 0), default=-1)


def _partial(text: str, markers: Sequence[str]) -> int:
    """The length of the longest end of `text` that begins one of `markers` (held back)."""
    return max((k for m in markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)
