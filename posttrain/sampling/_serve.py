"""`posttrain serve`: the OpenAI HTTP API over the continuous-batching engine.

`GET /health`, `GET /v1/models`, `GET /v1/stats`, `POST /v1/completions` and
`POST /v1/chat/completions` (the tokenizer's chat template, tools, `<tool_call>` blocks parsed
into `tool_calls`), each answered whole or streamed as Server-Sent Events in OpenAI's chunk
format. This module only parses, checks and formats; every model call goes through
`_backend._Backend` (one worker thread owning one `Engine`, shared by every client).

FastAPI and uvicorn are imported when an app is built, not with `posttrain.sampling` (so this
module evaluates its annotations: FastAPI reads the handlers' `fastapi.Request` at build time).
"""

import asyncio
import json
import secrets
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable

import jinja2

from posttrain.data import parse_tool_calls
from posttrain.errors import UserError
from posttrain.models import Transformer
from posttrain.sampling._backend import (
    EngineFailed,
    Piece,
    ServeConfig,
    Settings,
    _Backend,
    _first,
    _partial,
)
from posttrain.sampling._generate import Completion, _encode, check_settings

_OPEN = "<tool_call>"


def _tool_calls(text: str) -> tuple[str, list[dict]]:
    """(the text outside the blocks, OpenAI tool calls) of `text`'s
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, arguments as a JSON
    string as the API returns them; when any block is not such a call, the text stays text
    and there are no calls."""
    turn = parse_tool_calls(text, "hermes")
    if turn.errors or not turn.tool_calls:
        return text, []
    calls = [
        {**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
        for c in turn.tool_calls
    ]
    return turn.content, calls


class _APIError(Exception):
    """A refused request: HTTP `status` with OpenAI's error body."""

    def __init__(self, message: str, *, status=400, kind="invalid_request_error", param=None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param

    def body(self) -> dict:
        return {
            "error": {"message": str(self), "type": self.kind, "param": self.param, "code": None}
        }


def _engine_error(e: EngineFailed) -> _APIError:
    return _APIError(str(e), status=500, kind="server_error")


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
        content = m.get("content")
        if not isinstance(m.get("role"), str):
            raise _APIError("each message needs a 'role' string", param="messages")
        if content is not None and not isinstance(content, (str, list)):
            raise _APIError(
                "a message's 'content' must be a string, a list of text parts or null, got "
                f"{json.dumps(content)[:60]}",
                param="messages",
            )
        if isinstance(content, list):  # content parts: text only
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content
            ):
                raise _APIError("only text content parts are supported", param="messages")
            m = {**m, "content": "".join(p.get("text", "") for p in m["content"])}
        rendered.append({"content": None, **m} if "tool_calls" in m else m)
    try:
        return tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tools=tools)
    except (ValueError, TypeError, jinja2.TemplateError) as e:
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


def api_app(title: str):
    """A FastAPI app whose errors are OpenAI's: a refused request (`_APIError`) as its status
    and error body, a failed engine step as a 500."""
    import fastapi
    from fastapi.responses import JSONResponse

    app = fastapi.FastAPI(title=title)

    @app.exception_handler(_APIError)
    async def refused(request, e: _APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(EngineFailed)
    async def failed(request, e: EngineFailed):
        return JSONResponse(_engine_error(e).body(), status_code=500)

    return app


def create_app(backend, config: ServeConfig):
    """The FastAPI app of the OpenAI API over `backend` (a `_Backend`, or anything with its
    `tokenizer`, `max_seq_len`, `stats`, and the coroutine `complete` and async generator
    `stream`)."""
    import fastapi
    from fastapi.responses import StreamingResponse

    app = api_app(f"posttrain serve: {config.model_name}")
    slots = threading.BoundedSemaphore(config.max_requests)
    started = int(time.time())

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

    limit = config.max_body_bytes
    # A prompt of more characters than this holds more than max_seq_len tokens, whatever the
    # text: refused before the tokenizer spends seconds on it (4x spare for normalisers that
    # shrink text).
    longest = getattr(backend.tokenizer, "max_token_chars", None)  # (a stand-in may have none)
    most_chars = 4 * backend.max_seq_len * longest() if longest else float("inf")

    def check_chars(texts, param: str) -> None:
        chars = sum(len(t) for t in texts if isinstance(t, str))
        if chars > most_chars:
            raise _APIError(
                f"This model's maximum context length is {backend.max_seq_len} tokens, and "
                f"the {param} has {chars} characters, which cannot fit; shorten it",
                param=param,
            )

    def too_large(size: str) -> _APIError:
        return _APIError(
            f"the request body is {size} bytes; this server takes at most {limit} "
            "(posttrain serve --max-body-mb)",
            status=413,
        )

    async def body_of(request: fastapi.Request) -> dict:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:  # refused before it is read
            raise too_large(declared)
        raw = bytearray()
        async for part in request.stream():  # (a body without a length: counted as it comes)
            raw += part
            if len(raw) > limit:
                raise too_large(f"more than {limit}")
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):  # (RecursionError: nested too deep to parse)
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
            except EngineFailed as e:  # mid-stream: the status is sent already
                yield f"data: {json.dumps(_engine_error(e).body())}\n\n"
                return
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: fastapi.Request):
        body = await body_of(request)
        prompt = body.get("prompt")
        for text in prompt if isinstance(prompt, list) else [prompt]:
            check_chars([text], "prompt")
        # Tokenizing a long prompt takes a while: off the event loop, which answers /health.
        prompts = await asyncio.to_thread(_prompt_ids, backend.tokenizer, prompt)
        reply = _Reply(config.model_name, sum(map(len, prompts)), chat=False)
        return await answer(body, prompts, reply)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: fastapi.Request):
        body = await body_of(request)
        tools = _tools(body)
        messages = body.get("messages")
        if isinstance(messages, list):
            check_chars([m.get("content") for m in messages if isinstance(m, dict)], "messages")
        prompt = await asyncio.to_thread(_chat_ids, backend.tokenizer, messages, tools)
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
    mtp=None,
) -> None:
    """Serves the OpenAI API over `model` until interrupted (Ctrl-C or SIGTERM).

    Args:
      model: the `Transformer` to sample from.
      tokenizer: its `posttrain.data.Tokenizer` (encodes prompts, renders chat templates).
      config: the served name, the engine's settings (its preset) and request limits.
      host: the address to listen on (0.0.0.0 for every interface).
      port: the port; 0 picks a free one (the printed URL names it).
      mesh: the `jax.sharding.Mesh` the model is sharded over, if any.
      mtp: the model's `MTPModule` (`models.mtp_from_hf`): speculative rounds draft with it
        instead of prompt lookup (`config.speculative` tokens a round).

    Raises:
      UserError: the address cannot be listened on, or the engine's KV pool (`num_blocks`)
        cannot hold one `max_seq_len` sequence.
    """
    import uvicorn

    try:
        backend = _Backend(model, tokenizer, config, mesh=mesh, mtp=mtp)
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
