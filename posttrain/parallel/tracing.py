"""OpenTelemetry spans of a run's steps, joined across processes by the step.

`train.trace = True` turns it on (`configure`, from the train loop). Each step is one trace
whose id every process derives from the workdir and the step, so their spans join without a
message between them: process 0 writes the root span `step`, each process a `process` span
under it (process 0's too), and the work of the step nests under its process's span: `batch`
(the data; RL: `generate`, `env.reset` / `env.step` / `env.close` with a `tool_call` per call,
and `reward` with a `reward.call` per completion scored) and `update` (the step's dispatch; its
device time runs into the next step, metrics come back a step late). An evaluation is a trace
of its own, rooted at `eval`, joined the same way.

Spans go to an OTLP collector when one is configured (`train.trace_endpoint`, or OpenTelemetry's
own `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT`), else to
`<workdir>/traces/process<i>.jsonl`, one JSON object a span (`ReadableSpan.to_json`; uploaded
at the end under a gs:// workdir). Without `configure` every call here is a no-op: nothing is
imported and nothing is written.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import json
import os
import tempfile
import threading
import time

from posttrain import paths

_STATE: dict = {}  # "tracer", "provider", "key", "process", "upload"


def enabled() -> bool:
    """Whether spans are being recorded."""
    return "tracer" in _STATE


def configure(workdir: str, *, endpoint: str = "", process: int = 0) -> str:
    """Starts recording this process's spans; returns where they go (a URL or a file).

    Raises:
      ImportError (with what to install): opentelemetry-sdk, or for OTLP its HTTP exporter, is
        missing.
    """
    shutdown()
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError:
        raise ImportError(
            "train.trace needs OpenTelemetry: pip install 'posttrain[trace]' "
            "(opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http)"
        ) from None
    endpoint = endpoint or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or ""
    if not endpoint and os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        endpoint = os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"].rstrip("/") + "/v1/traces"
    resource = Resource.create({"service.name": "posttrain", "posttrain.process": process})
    provider = TracerProvider(resource=resource, id_generator=_ids())
    upload = None
    if endpoint:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ImportError(
                "an OTLP endpoint needs opentelemetry-exporter-otlp-proto-http: pip install "
                "'posttrain[trace]'"
            ) from None
        exporter, where = OTLPSpanExporter(endpoint=endpoint), endpoint
    else:
        folder = paths.join(workdir, "traces")
        local = folder
        if paths.is_remote(folder):
            local = tempfile.mkdtemp(prefix="posttrain-traces-")
            upload = (local, folder)
        os.makedirs(local, exist_ok=True)
        where = os.path.join(local, f"process{process}.jsonl")
        out = open(where, "a", encoding="utf-8")  # noqa: SIM115 (closed by shutdown)
        exporter = ConsoleSpanExporter(out=out, formatter=_one_line)
        if upload is not None:
            where = paths.join(folder, f"process{process}.jsonl")
    provider.add_span_processor(BatchSpanProcessor(exporter))
    _STATE.update(tracer=provider.get_tracer("posttrain"), provider=provider, upload=upload,
                  key=str(workdir), process=process)  # fmt: skip
    return where


def shutdown() -> None:
    """Exports what is left and stops recording (a no-op when not recording)."""
    provider, upload = _STATE.get("provider"), _STATE.get("upload")
    _STATE.clear()
    if provider is not None:
        provider.shutdown()  # flushes, and closes the file exporter's stream
    if upload is not None:
        paths.upload(*upload)


def span(name: str, **attributes):
    """A span named `name` under the current one, for a `with` block (a no-op when off)."""
    tracer = _STATE.get("tracer")
    if tracer is None:
        return contextlib.nullcontext()
    return tracer.start_as_current_span(name, attributes=_plain(attributes))


@contextlib.contextmanager
def step_span(step: int, kind: str = "step"):
    """The step's spans: the root, named `kind` (process 0's), and this process's; the block
    runs inside the latter. Each kind of a step ("step", "eval") is a trace of its own."""
    tracer = _STATE.get("tracer")
    if tracer is None:
        yield
        return
    from opentelemetry import trace
    from opentelemetry.context import Context

    trace_id, root_id = _id(128, kind, "trace", step), _id(64, kind, "root", step)
    process = _STATE["process"]
    with contextlib.ExitStack() as stack:
        if process == 0:
            _NEXT.ids = (trace_id, root_id)
            stack.enter_context(tracer.start_as_current_span(
                kind, context=Context(), attributes={"step": step}))  # fmt: skip
        root = trace.NonRecordingSpan(trace.SpanContext(
            trace_id, root_id, is_remote=True, trace_flags=trace.TraceFlags(1)))  # fmt: skip
        _NEXT.ids = (trace_id, _id(64, kind, "process", step, process))
        stack.enter_context(tracer.start_as_current_span(
            "process", context=trace.set_span_in_context(root),
            attributes={"step": step, "process": process}))  # fmt: skip
        yield


def in_context(fn):
    """`fn` to run on another thread inside the current span (a no-op when off)."""
    if not enabled():
        return fn
    return functools.partial(contextvars.copy_context().run, fn)


def record(name: str, start_ns: int, end_ns: int, **attributes) -> None:
    """A finished span under the current one, timed by the caller (`time.time_ns()`)."""
    tracer = _STATE.get("tracer")
    if tracer is not None:
        tracer.start_span(name, start_time=start_ns, attributes=_plain(attributes)).end(end_ns)


def now_ns() -> int:
    return time.time_ns()


def _id(bits: int, *parts) -> int:
    """A nonzero id of `bits` bits from the run (its workdir) and `parts`."""
    digest = hashlib.sha256(json.dumps([_STATE["key"], *parts]).encode()).digest()
    return int.from_bytes(digest[: bits // 8], "big") or 1


def _plain(attributes: dict) -> dict:
    return {k: v if isinstance(v, bool | int | float | str) else str(v)
            for k, v in attributes.items() if v is not None}  # fmt: skip


def _one_line(span) -> str:
    return json.dumps(json.loads(span.to_json()), separators=(",", ":")) + "\n"


_NEXT = threading.local()  # .ids: (trace id, span id) the thread's next span takes


def _ids():
    """OpenTelemetry's random id generator, except that a thread may name the next span's
    trace and span ids (`_NEXT.ids`), which the step spans take from the workdir and the
    step."""
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class Ids(RandomIdGenerator):
        def generate_trace_id(self) -> int:
            ids = getattr(_NEXT, "ids", None)
            return ids[0] if ids else super().generate_trace_id()

        def generate_span_id(self) -> int:
            ids = getattr(_NEXT, "ids", None)
            _NEXT.ids = None
            return ids[1] if ids else super().generate_span_id()

    return Ids()
