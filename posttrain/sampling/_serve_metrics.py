"""`GET /metrics` of `posttrain serve`: Prometheus' text format (prometheus-client), one
registry per app. HTTP requests by path and status; the admission queue (requests, sequences,
KV tokens admitted); the engine (KV blocks in use and in the pool, prompts it holds, tokens
generated and their rate over the last seconds, XLA compilations)."""

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from posttrain.sampling._admission import Admission


class _Engine:
    """Reads the backend's `stats()` once per scrape."""

    def __init__(self, backend):
        self.backend = backend

    def collect(self):
        s = self.backend.stats()
        for name, text, value in (
            ("kv_blocks_in_use", "KV blocks holding sequences", s["blocks_in_use"]),
            ("kv_blocks_cached", "KV blocks the prefix cache keeps", s["blocks_cached"]),
            ("kv_blocks", "KV blocks in the pool", s["num_blocks"]),
            ("engine_prompts", "prompts in the engine, decoding or waiting for a row",
             s["requests"]),
            ("tokens_per_second", "tokens generated per second over the last seconds",
             s["tokens_per_second"]),
        ):  # fmt: skip
            yield GaugeMetricFamily(f"posttrain_{name}", text, value=value)
        yield CounterMetricFamily(
            "posttrain_generated_tokens", "tokens generated", value=s["generated_tokens"]
        )
        yield CounterMetricFamily(
            "posttrain_compilations", "XLA programs compiled (one per engine bucket met)",
            value=s["compilations"],
        )  # fmt: skip


class ServeMetrics:
    """The app's metrics; `requests` is counted by the app as it answers."""

    def __init__(self, backend, admission: Admission):
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter(
            "posttrain_requests", "HTTP requests answered, by path and status",
            ["path", "status"], registry=self.registry,
        )  # fmt: skip
        for name, text, read in (
            ("queue_requests", "requests admitted and not yet answered", "requests"),
            ("queue_sequences", "sequences (n x prompts) admitted", "sequences"),
            ("queue_tokens", "KV tokens admitted (prompts + n x max_tokens)", "tokens"),
        ):
            gauge = Gauge(f"posttrain_{name}", text, registry=self.registry)
            gauge.set_function(lambda read=read: getattr(admission, read))
        self.registry.register(_Engine(backend))
