"""`posttrain serve`: the OpenAI HTTP API over the continuous-batching engine.

`GET /health`, `GET /metrics` (Prometheus), `GET /v1/models`, `GET /v1/stats`,
`POST /v1/completions` and `POST /v1/chat/completions` (the tokenizer's chat template, tools,
`<tool_call>` blocks parsed into `tool_calls`), each answered whole or streamed as Server-Sent
Events in OpenAI's chunk format. The app checks the key, the body's size, then the request
(`_serve_request`), admits its cost (`_admission`) and formats the answer (`_serve_reply`);
every model call goes through `_backend._Backend` (one worker thread owning one `Engine`,
shared by every client). A client that goes away, whole or streaming, cancels its work.

FastAPI and uvicorn are imported when an app is built, not with `posttrain.sampling` (so this
module evaluates its annotations: FastAPI reads the handlers' `fastapi.Request` at build time).
"""

import asyncio
import contextlib
import hmac
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from posttrain.errors import UserError
from posttrain.models import Transformer
from posttrain.sampling._admission import Admission, cost
from posttrain.sampling._backend import EngineFailed, Piece, ServeConfig, _Backend
from posttrain.sampling._serve_reply import _Reply
from posttrain.sampling._serve_request import (
    _APIError,
    _chat_ids,
    _get,
    _prompt_ids,
    _settings,
    _tools,
)

# How often a handler waiting on the engine asks whether its client is still there.
_POLL_S = 0.2
# The status counted (in /metrics) for a request whose client left before the answer.
_GONE = 499


def _engine_error(e: EngineFailed) -> _APIError:
    return _APIError(str(e), status=500, kind="server_error")


class _ClientGone(Exception):
    """The client closed its connection while its request waited on the engine."""


async def _unless_gone(request, work: Awaitable):
    """`work`'s result; cancels it and raises `_ClientGone` if `request`'s client goes away."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=_POLL_S)
            if not task.done() and await request.is_disconnected():
                raise _ClientGone
        return task.result()
    finally:
        if not task.done():  # gone, or this handler cancelled (the server is shutting down)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


class _Counted:
    """ASGI middleware counting each HTTP response in /metrics by path and status."""

    def __init__(self, app, *, metrics, paths: frozenset[str]):
        self.app, self.metrics, self.paths = app, metrics, paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"] if scope["path"] in self.paths else "other"

        async def counted(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(path, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)


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
    from starlette.exceptions import HTTPException

    app = fastapi.FastAPI(title=title)

    @app.exception_handler(HTTPException)  # an unknown path or method: OpenAI's body too
    async def unrouted(request, e: HTTPException):
        body = _APIError(str(e.detail), status=e.status_code).body()
        return JSONResponse(body, status_code=e.status_code, headers=e.headers)

    @app.exception_handler(_APIError)
    async def refused(request, e: _APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(EngineFailed)
    async def failed(request, e: EngineFailed):
        return JSONResponse(_engine_error(e).body(), status_code=500)

    return app


def create_app(backend, config: ServeConfig):
    """The FastAPI app of the OpenAI API over `backend` (a `_Backend`, or anything with its
    `tokenizer`, `max_seq_len`, `kv_tokens`, `stats`, and the coroutine `complete` and async
    generator `stream`)."""
    import fastapi
    from fastapi.responses import Response, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    from posttrain.sampling._serve_metrics import ServeMetrics

    app = api_app(f"posttrain serve: {config.model_name}")
    admission = Admission(
        max_request_samples=config.max_request_samples,
        max_sequences=config.max_sequences or 4 * config.engine.slots,
        max_tokens=config.max_queue_tokens or 4 * backend.kv_tokens,
    )
    metrics = ServeMetrics(backend, admission)
    started = int(time.time())
    key = config.api_key.encode()

    def authorize(request: fastapi.Request) -> None:
        if not key:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if not (scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key)):
            raise _APIError(
                "Incorrect API key provided: send 'Authorization: Bearer <key>' with the key "
                "this server was started with (posttrain serve --api-key or POSTTRAIN_API_KEY)",
                status=401, code="invalid_api_key",
            )  # fmt: skip

    v1 = fastapi.APIRouter(prefix="/v1", dependencies=[fastapi.Depends(authorize)])

    @app.get("/health")
    async def health():  # (on the event loop: answers while the thread pool is busy)
        return {"status": "ok"}

    @app.get("/metrics")
    def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @v1.get("/models")
    def models():
        model = {"id": config.model_name, "object": "model", "created": started,
                 "owned_by": "posttrain", "max_model_len": backend.max_seq_len}  # fmt: skip
        return {"object": "list", "data": [model]}

    @v1.get("/stats")
    def stats():
        return {**backend.stats(), "queue": {"requests": admission.requests,
                "sequences": admission.sequences, "tokens": admission.tokens}}  # fmt: skip

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

    async def answer(request, body: dict, prompts: list[list[int]], reply: _Reply):
        settings = _settings(body, prompts, backend.max_seq_len, config)
        include_usage = bool((_get(body, "stream_options", dict) or {}).get("include_usage"))
        release = admission.admit(cost(prompts, settings))
        if not body.get("stream"):
            try:
                results = await _unless_gone(request, backend.complete(prompts, settings))
            except _ClientGone:
                return Response(status_code=_GONE)
            finally:
                release()
            return reply.whole(results)
        # The first piece (prefill and a chunk of tokens) comes before the response starts, so
        # that a failure is still an HTTP error; a stream releases its admission when it ends,
        # fails or is dropped (and cancels its engine request, freeing its row).
        pieces = _released(backend.stream(prompts[0], settings), release)
        started = False
        try:
            first = await _unless_gone(request, anext(pieces))
            started = True
        except _ClientGone:
            return Response(status_code=_GONE)
        finally:
            if not started:  # failed or gone: `pieces` closed, its admission given back (once)
                await pieces.aclose()
                release()  # (aclose of a generator that never ran skips its `finally`)

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

    @v1.post("/completions")
    async def completions(request: fastapi.Request):
        body = await body_of(request)
        prompt = body.get("prompt")
        for text in prompt if isinstance(prompt, list) else [prompt]:
            check_chars([text], "prompt")
        # Tokenizing a long prompt takes a while: off the event loop, which answers /health.
        prompts = await asyncio.to_thread(_prompt_ids, backend.tokenizer, prompt)
        reply = _Reply(config.model_name, sum(map(len, prompts)), chat=False)
        return await answer(request, body, prompts, reply)

    @v1.post("/chat/completions")
    async def chat_completions(request: fastapi.Request):
        body = await body_of(request)
        tools = _tools(body)
        messages = body.get("messages")
        if isinstance(messages, list):
            check_chars([m.get("content") for m in messages if isinstance(m, dict)], "messages")
        prompt = await asyncio.to_thread(_chat_ids, backend.tokenizer, messages, tools)
        reply = _Reply(config.model_name, len(prompt), chat=True, tools=tools)
        return await answer(request, body, [prompt], reply)

    app.include_router(v1)
    paths = frozenset(getattr(route, "path", "") for route in [*app.routes, *v1.routes])
    app.add_middleware(_Counted, metrics=metrics, paths=paths)
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
    """Serves the OpenAI API over `model` until interrupted (Ctrl-C or SIGTERM: the answers in
    flight get `config.drain_s` seconds, then the server exits).

    Args:
      model: the `Transformer` to sample from.
      tokenizer: its `posttrain.data.Tokenizer` (encodes prompts, renders chat templates).
      config: the served name, the engine's settings (its preset) and request limits.
      host: the address to listen on (0.0.0.0 for every interface).
      port: the port; 0 picks a free one (the printed URL names it).
      mesh: the `jax.sharding.Mesh` the model is sharded over, if any.
      mtp: the model's `MTPModule` (`models.mtp_from_hf`): speculative rounds draft with it
        instead of prompt lookup (`config.engine.speculative` tokens a round).

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
        # On SIGTERM or Ctrl-C uvicorn stops listening, gives the answers in flight
        # `drain_s` seconds, then cancels them (their engine requests with them).
        server = uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=config.drain_s)
        uvicorn.Server(server).run(sockets=[sock])
    finally:
        backend.close()
