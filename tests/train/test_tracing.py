"""`posttrain.parallel.tracing`: spans reach an OTLP collector when one is configured (a local
HTTP receiver here, decoding what OpenTelemetry's exporter sends), and cost nothing when
tracing is off. (A 2-process GRPO run's span trees: tests/rl/test_multihost.py; environment
steps and tool calls on 2 processes: tests/envs/test_calculator.py, slow.)"""

import http.server
import threading

from posttrain.parallel import tracing


class _Receiver(http.server.BaseHTTPRequestHandler):
    bodies: list = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        self.bodies.append((self.path, self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        """Quiet: http.server would print a line per request."""


def test_spans_go_to_an_otlp_collector_when_one_is_configured(tmp_path):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    server = http.server.HTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_port}/v1/traces"
    try:
        assert tracing.configure(str(tmp_path), endpoint=endpoint, process=1) == endpoint
        with tracing.step_span(7), tracing.span("batch", rows=4):
            tracing.record("reward.call", tracing.now_ns(), tracing.now_ns(), domain="math")
        tracing.shutdown()
    finally:
        server.shutdown()
    assert not (tmp_path / "traces").exists()  # nothing to the file
    spans = []
    for path, body in _Receiver.bodies:
        assert path == "/v1/traces"
        request = ExportTraceServiceRequest.FromString(body)
        for resource in request.resource_spans:
            attributes = {a.key: a.value for a in resource.resource.attributes}
            assert attributes["posttrain.process"].int_value == 1
            spans += [s for scope in resource.scope_spans for s in scope.spans]
    names = {s.name: s for s in spans}
    assert sorted(names) == ["batch", "process", "reward.call"]  # (process 1 has no root)
    assert names["reward.call"].parent_span_id == names["batch"].span_id
    assert names["batch"].parent_span_id == names["process"].span_id
    # The process span hangs under the step's root, whose ids every process derives alike.
    assert len({s.trace_id for s in spans}) == 1 and names["process"].parent_span_id


def test_off_is_free_and_writes_nothing(tmp_path):
    assert not tracing.enabled()
    with tracing.step_span(1), tracing.span("batch"):
        tracing.record("reward.call", 0, 1)
    assert tracing.in_context(len) is len
    assert list(tmp_path.iterdir()) == []
