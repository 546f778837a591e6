"""`posttrain serve`: the OpenAI HTTP API over the continuous-batching engine.

`GET /health`, `GET /v1/models`, `GET /v1/stats`, `POST /v1/completions` and
`POST /v1/chat/completions` (the tokenizer's chat template, tools, `<tool_call>` blocks parsed
into `tool_calls`), each answered whole or streamed as Server-Sent Events in OpenAI's chunk
format. The HTTP layer only parses, checks and formats; every model call goes through
`_Backend`: one worker thread owns one `Engine` and loops (take new requests, `step`, hand each
request the tokens it gained), so requests from every HTTP client decode together in the
engine's rows, and a row freed by a finished answer takes the next waiting one. Each prompt of
an HTTP request is one engine `Request`; its handler awaits its tokens on its own asyncio queue,
so the event loop never waits on the device. Stop strings are checked on the host after each
engine step: a sample that hit one (or whose client went away) is cancelled, freeing its row.

FastAPI and uvicorn are imported when an app is built, not with `posttrain.sampling` (so this
module evaluates its annotations: FastAPI reads the handlers' `fastapi.Request` at build time).
"""

import asyncio
import contextlib
import dataclasses
import json
import queue
import re
import secrets
import socket
import threading
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import NamedTuple

import jax
import jinja2
import numpy as np

from posttrain.errors import UserError
from posttrain.models import Transformer
from posttrain.sampling._engine import Engine, EngineConfig, Request
from posttrain.sampling._generate import Completion, _encode, _finish, check_settings
from posttrain.sampling._speculative import PromptLookup

# How each preset sets the engine (see docs/generation.md, "Serving").
PRESETS = {
    # 64 rows decode together, 16 steps per device call: the most tokens per second; a new
    # request waits up to one 16-step call for its prefill. Prompts pad to 64-token buckets.
    "throughput": dict(slots=64, chunk=16, prefill_bucket=64),
    # 8 rows, 4 rounds per call, speculative decoding with prompt lookup (4 drafts a round): a
    # new request starts (and streams its first tokens) within a few steps, and text that
    # repeats its context comes out several tokens per forward; a lower total throughput.
    # Prompts pad to 16-token buckets.
    "latency": dict(slots=8, chunk=4, prefill_bucket=16, speculative=4),
}


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """What the server runs with; `ServeConfig.from_preset` fills the engine fields."""

    model_name: str = "posttrain"  # the id /v1/models lists and requests name
    preset: str = "throughput"  # the PRESETS entry the engine fields came from
    slots: int = 64  # samples decoded together (engine rows); more wait for a free row
    chunk: int = 16  # decode steps per device call; requests join and leave between calls
    prefill_bucket: int = 64  # prompts padded to a multiple of this (bounds compilations)
    # KV pool blocks of 16 tokens; 0 gives every row room for a max_seq_len sequence
    # (slots x max_seq_len tokens: small for small models, set it for long-context ones).
    num_blocks: int = 0
    # Prompt-lookup drafts per speculative round (0: plain decoding). Greedy answers are the
    # same either way; seeded samples are reproducible, but other draws than plain decoding's.
    speculative: int = 0
    max_requests: int = 64  # requests in flight or waiting for the engine; more get HTTP 429
    default_max_tokens: int = 256  # max_tokens of a request that gives none (cut to fit)

    @classmethod
    def from_preset(cls, preset: str, **overrides) -> "ServeConfig":
        """The config of a PRESETS entry, with fields replaced by `overrides`."""
        if preset not in PRESETS:
            raise ValueError(f"unknown serve preset {preset!r}; choose one of {sorted(PRESETS)}")
        return cls(preset=preset, **{**PRESETS[preset], **overrides})


@dataclasses.dataclass(frozen=True)
class Settings:
    """One request's sampling settings, checked (see `check_settings`)."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
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
        """The next update; HTTP 500 if the engine failed."""
        update = await self.updates.get()
        if isinstance(update, str):
            raise _APIError(update, status=500, kind="server_error")
        self.finished = update.finished
        return update


class _Backend:
    """The server's engine, owned by a worker thread that decodes every handler's requests
    together; handlers `complete` or `stream` from the event loop."""

    def __init__(self, model: Transformer, tokenizer, config: ServeConfig, *, mesh=None):
        self.tokenizer = tokenizer
        self.max_seq_len = model.config.max_seq_len
        self._model, self._config, self._mesh = model, config, mesh
        self._eos = frozenset(tokenizer.eos_ids)
        with self._on_mesh():
            self.engine = self._new_engine()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # ("submit" | "cancel", track)
        self._active: list[_Track] = []  # submitted and not finished; the worker's alone
        self._worker = threading.Thread(target=self._work, name="posttrain-engine", daemon=True)
        self._worker.start()

    def _on_mesh(self):
        return jax.set_mesh(self._mesh) if self._mesh is not None else contextlib.nullcontext()

    def _new_engine(self) -> Engine:
        c = self._config
        config = EngineConfig(slots=c.slots, chunk=c.chunk, prefill_bucket=c.prefill_bucket,
                              num_blocks=c.num_blocks)  # fmt: skip
        drafter = PromptLookup(k=c.speculative) if c.speculative else None
        return Engine(self._model, config, eos_ids=self.tokenizer.eos_ids, drafter=drafter)

    def close(self) -> None:
        """Stops the worker (after its current step)."""
        self._inbox.put(("close", None))
        self._worker.join()

    def stats(self) -> dict:
        """The engine's settings, its counters since start (`EngineStats`) and what it holds."""
        engine = self.engine
        return {"preset": self._config.preset, "slots": engine.config.slots,
                "chunk": engine.config.chunk, "num_blocks": engine.num_blocks,
                "speculative": self._config.speculative,
                "blocks_in_use": engine.blocks_in_use, "requests": len(self._active),
                **dataclasses.asdict(engine.stats)}  # fmt: skip

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
            key=jax.random.key(np.uint32(track.seed)), n=s.n, temperature=s.temperature,
            top_k=s.top_k, top_p=s.top_p,
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


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_TOOL_CALL = re.compile(f"{_OPEN}(.*?){_CLOSE}", re.DOTALL)


def _tool_calls(text: str) -> tuple[str, list[dict]]:
    """(the text outside the blocks, OpenAI tool calls) of `text`'s
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; when any block is not
    such a call, the text stays text and there are no calls."""
    calls = []
    for block in _TOOL_CALL.findall(text):
        try:
            call = json.loads(block)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        arguments = call.get("arguments", {})
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": call["name"],
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                },
            }
        )
    return (_TOOL_CALL.sub("", text) if calls else text), calls


class _APIError(Exception):
    """A refused request: HTTP `status` with OpenAI's error body."""

    def __init__(self, message: str, *, status=400, kind="invalid_request_error", param=None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param

    def body(self) -> dict:
        return {
            "error": {"message": str(self), "type": self.kind, "param": self.param, "code": None}
        }


_KINDS = {int: "an integer", float: "a number", bool: "true or false", dict: "an object"}
# Accepted only at their neutral values (absent, null, false, 0, 1 for best_of, text format).
_UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "best_of", "suffix", "logit_bias",
                "presence_penalty", "frequency_penalty", "response_format")  # fmt: skip


def _get(body: dict, name: str, kind: type, default=None):
    """`body[name]` if it is of `kind` (float takes ints; only bool takes bools), else 400."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float) if kind is float else kind) or (
        isinstance(value, bool) and kind is not bool
    ):
        raise _APIError(
            f"{name!r} must be {_KINDS[kind]}, got {json.dumps(value)[:60]}", param=name
        )
    return value


def _settings(body: dict, prompts: list[list[int]], limit: int, config: ServeConfig) -> Settings:
    """The request's checked settings; 400 when one is out of range or a prompt is too long."""
    for name in _UNSUPPORTED:
        value = body.get(name)
        if value and value != {"type": "text"} and not (name == "best_of" and value == 1):
            raise _APIError(f"{name!r} is not supported by posttrain serve", param=name)
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise _APIError("'stop' must be a string or a list of non-empty strings", param="stop")
    requested = _get(body, "max_completion_tokens", int, _get(body, "max_tokens", int))
    if requested is not None and requested < 1:
        raise _APIError(f"max_tokens must be >= 1, got {requested}", param="max_tokens")
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    size = len(prompts[longest])
    max_tokens = requested or min(config.default_max_tokens, limit - size)
    if size + max(max_tokens, 1) > limit:
        which = "the prompt" if len(prompts) == 1 else f"prompt {longest}"
        raise _APIError(
            f"This model's maximum context length is {limit} tokens, but {which} has {size} "
            + (
                f"tokens and max_tokens is {max_tokens} ({size + max_tokens} in all); shorten "
                "the prompt or lower max_tokens"
                if requested
                else "tokens, which leaves no room for the completion; shorten the prompt"
            ),
            param="messages" if "messages" in body else "prompt",
        )
    settings = Settings(
        max_tokens=max_tokens,
        temperature=float(_get(body, "temperature", float, 1.0)),
        top_p=float(_get(body, "top_p", float, 1.0)),
        top_k=_get(body, "top_k", int, 0),
        n=_get(body, "n", int, 1),
        seed=_get(body, "seed", int, secrets.randbelow(2**31)) % 2**32,
        stop=tuple(stop),
    )
    try:
        check_settings(
            max_new_tokens=max_tokens, temperature=settings.temperature, top_p=settings.top_p,
            top_k=settings.top_k, n=settings.n,
        )  # fmt: skip
    except ValueError as e:
        raise _APIError(str(e)) from None
    if _get(body, "stream", bool, False) and (settings.n > 1 or len(prompts) > 1):
        raise _APIError("a streamed request takes one prompt and n=1", param="stream")
    return settings


def _prompt_ids(tokenizer, prompt) -> list[list[int]]:
    """The token ids of /v1/completions' `prompt`: a string, token ids, or a list of either."""
    ids = isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)
    prompts = [prompt] if isinstance(prompt, str) or ids else prompt
    if (
        not isinstance(prompts, list)
        or not prompts
        or not all(
            isinstance(p, str) or (isinstance(p, list) and all(type(t) is int for t in p))
            for p in prompts
        )
    ):
        raise _APIError(
            "'prompt' must be a string, a list of token ids, or a non-empty list of either",
            param="prompt",
        )
    try:
        ids = _encode(tokenizer, prompts)
    except ValueError as e:
        raise _APIError(str(e), param="prompt") from None
    if bad := [t for p in ids for t in p if not 0 <= t < tokenizer.vocab_size]:
        raise _APIError(
            f"token id {bad[0]} is outside the vocabulary (0 to {tokenizer.vocab_size - 1})",
            param="prompt",
        )
    return ids


def _chat_ids(tokenizer, messages, tools) -> list[int]:
    """The chat template's rendering of `messages` (OpenAI's shape) with the generation prompt."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise _APIError("'messages' must be a list of message objects", param="messages")
    rendered = []
    for m in messages:
        if isinstance(m.get("content"), list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in m["content"]):
                raise _APIError("only text content parts are supported", param="messages")
            m = {**m, "content": "".join(p.get("text", "") for p in m["content"])}
        rendered.append({"content": None, **m} if "tool_calls" in m else m)
    try:
        return tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tools=tools)
    except (ValueError, jinja2.TemplateError) as e:
        raise _APIError(f"cannot render the messages with the chat template: {e}") from None


def _tools(body: dict) -> list[dict] | None:
    """The request's tools for the template; none with tool_choice "none"."""
    tools, choice = body.get("tools"), body.get("tool_choice", "auto")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise _APIError("'tools' must be a list of tool objects", param="tools")
    if choice not in ("auto", "none"):
        raise _APIError("only tool_choice 'auto' and 'none' are supported", param="tool_choice")
    return tools if tools and choice == "auto" else None


class _Reply:
    """The response of one request: whole (`whole`) or as chunks (`chunks`)."""

    def __init__(self, model: str, prompt_tokens: int, *, chat: bool, tools=None):
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.model, self.prompt_tokens, self.chat, self.tools = model, prompt_tokens, chat, tools
        self.created = int(time.time())

    def _envelope(self, kind: str, choices: list[dict], usage: int | None = None) -> dict:
        out = {"id": self.id, "object": kind, "created": self.created, "model": self.model}
        out["choices"] = choices
        if usage is not None:
            out["usage"] = {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": usage,
                "total_tokens": self.prompt_tokens + usage,
            }
        return out

    def whole(self, results: list[list[Completion]]) -> dict:
        """The response of every prompt's completions, in order."""
        flat = [c for samples in results for c in samples]
        choices = []
        for index, c in enumerate(flat):
            if not self.chat:
                choices.append({"index": index, "text": c.text, "logprobs": None,
                                "finish_reason": c.finish_reason})  # fmt: skip
                continue
            content, calls = _tool_calls(c.text) if self.tools else (c.text, [])
            message = {"role": "assistant", "content": content if content.strip() else None}
            if calls:
                message["tool_calls"] = calls
            finish = "tool_calls" if calls else c.finish_reason
            choices.append({"index": index, "message": message, "logprobs": None,
                            "finish_reason": finish})  # fmt: skip
        kind = "chat.completion" if self.chat else "text_completion"
        return self._envelope(kind, choices, sum(len(c.token_ids) for c in flat))

    def _chunk(self, delta: dict | str, finish: str | None) -> dict:
        if self.chat:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}
        return self._envelope("text_completion", [choice])

    async def chunks(
        self, pieces: AsyncIterator[Piece], include_usage: bool
    ) -> AsyncIterator[dict]:
        """The streamed response; with tools, text from the first `<tool_call>` on is held
        back and sent at the end as `tool_calls` (or as text, if it does not parse)."""
        if self.chat:
            yield self._chunk({"role": "assistant", "content": ""}, None)
        content = (lambda text: {"content": text}) if self.chat else (lambda text: text)
        held, last = "", None
        async for last in pieces:
            held += last.text
            cut = _first(held, [_OPEN]) if self.tools else -1
            ready = cut if cut >= 0 else len(held) - (_partial(held, [_OPEN]) if self.tools else 0)
            if ready:
                yield self._chunk(content(held[:ready]), None)
                held = held[ready:]
        text, calls = _tool_calls(held) if self.tools else (held, [])
        if text and (text.strip() or not calls):
            yield self._chunk(content(text), None)
        if calls:
            yield self._chunk(
                {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}, None
            )
        yield self._chunk({} if self.chat else "", "tool_calls" if calls else last.finish_reason)
        if include_usage:
            kind = "chat.completion.chunk" if self.chat else "text_completion"
            yield self._envelope(kind, [], last.num_tokens)


async def _released(pieces: AsyncIterator[Piece], release: Callable[[], None]):
    """`pieces`, calling `release` when they end, fail, or are dropped (a client went away)."""
    try:
        async for piece in pieces:
            yield piece
    finally:
        release()


def create_app(backend, config: ServeConfig):
    """The FastAPI app of the OpenAI API over `backend` (a `_Backend`, or anything with its
    `tokenizer`, `max_seq_len`, `stats`, and the coroutine `complete` and async generator
    `stream`)."""
    import fastapi
    from fastapi.responses import JSONResponse, StreamingResponse

    app = fastapi.FastAPI(title=f"posttrain serve: {config.model_name}")
    slots = threading.BoundedSemaphore(config.max_requests)
    started = int(time.time())

    @app.exception_handler(_APIError)
    async def refused(request, e: _APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    def models():
        model = {"id": config.model_name, "object": "model", "created": started,
                 "owned_by": "posttrain", "max_model_len": backend.max_seq_len}  # fmt: skip
        return {"object": "list", "data": [model]}

    @app.get("/v1/stats")
    def stats():
        return backend.stats()

    async def body_of(request: fastapi.Request) -> dict:
        try:
            body = await request.json()
        except ValueError:
            raise _APIError("the request body is not JSON") from None
        if not isinstance(body, dict):
            raise _APIError("the request body must be a JSON object")
        if body.get("model") != config.model_name:
            raise _APIError(
                f"The model {body.get('model')!r} does not exist; this server serves "
                f"{config.model_name!r}", status=404, param="model",
            )  # fmt: skip
        return body

    async def answer(body: dict, prompts: list[list[int]], reply: _Reply):
        settings = _settings(body, prompts, backend.max_seq_len, config)
        include_usage = bool((_get(body, "stream_options", dict) or {}).get("include_usage"))
        if not slots.acquire(blocking=False):
            raise _APIError(
                f"the server is busy ({config.max_requests} requests in progress); retry later",
                status=429, kind="rate_limit_exceeded",
            )  # fmt: skip
        if not body.get("stream"):
            try:
                return reply.whole(await backend.complete(prompts, settings))
            finally:
                slots.release()
        # The first piece (prefill and a chunk of tokens) comes before the response starts, so
        # that a failure is still an HTTP error; a started stream releases its slot when it
        # ends or is dropped (and cancels its engine request, freeing its row).
        pieces = _released(backend.stream(prompts[0], settings), slots.release)
        first = await anext(pieces)

        async def all_pieces():
            yield first
            async for piece in pieces:
                yield piece

        async def events():
            try:
                async for chunk in reply.chunks(all_pieces(), include_usage):
                    yield f"data: {json.dumps(chunk)}\n\n"
            except _APIError as e:  # the engine failed mid-stream: the status is sent already
                yield f"data: {json.dumps(e.body())}\n\n"
                return
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: fastapi.Request):
        body = await body_of(request)
        prompts = _prompt_ids(backend.tokenizer, body.get("prompt"))
        reply = _Reply(config.model_name, sum(map(len, prompts)), chat=False)
        return await answer(body, prompts, reply)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: fastapi.Request):
        body = await body_of(request)
        tools = _tools(body)
        prompt = _chat_ids(backend.tokenizer, body.get("messages"), tools)
        reply = _Reply(config.model_name, len(prompt), chat=True, tools=tools)
        return await answer(body, [prompt], reply)

    return app


def serve(
    model: Transformer,
    tokenizer,
    config: ServeConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    mesh=None,
) -> None:
    """Serves the OpenAI API over `model` until interrupted (Ctrl-C or SIGTERM).

    Args:
      model: the `Transformer` to sample from.
      tokenizer: its `posttrain.data.Tokenizer` (encodes prompts, renders chat templates).
      config: the served name, the engine's settings (its preset) and request limits.
      host: the address to listen on (0.0.0.0 for every interface).
      port: the port; 0 picks a free one (the printed URL names it).
      mesh: the `jax.sharding.Mesh` the model is sharded over, if any.

    Raises:
      UserError: the address cannot be listened on, or the engine's KV pool (`num_blocks`)
        cannot hold one `max_seq_len` sequence.
    """
    import uvicorn

    try:
        backend = _Backend(model, tokenizer, config, mesh=mesh)
    except ValueError as e:  # e.g. num_blocks too small for one max_seq_len sequence
        raise UserError(f"cannot build the serving engine: {e}") from None
    app = create_app(backend, config)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family)
    except OSError as e:
        backend.close()
        raise UserError(
            f"cannot listen on {host}:{port} ({e.strerror}); pick another --port"
        ) from None
    shown = f"[{host}]" if ":" in host else host
    print(
        f"serving {config.model_name!r} (preset {config.preset}) at "
        f"http://{shown}:{sock.getsockname()[1]}/v1",
        flush=True,
    )
    try:
        uvicorn.Server(uvicorn.Config(app, log_level="info")).run(sockets=[sock])
    finally:
        backend.close()
