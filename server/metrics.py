"""GET /metrics in Prometheus' text format, made with prometheus-client.

Two sources:

- this server's own measurements (``ServerMetrics``): vLLM's latency histograms under
  ``tandem:`` names of the same shape (time to first token, inter-token latency, end-to-end
  latency, queue and prefill time, one observation per engine request), requests by finish
  reason, and HTTP responses by status; and the two hops of a first token that are this
  server's own (its arrival to its send to the engine; the first token's arrival to its
  text passed on), so that a request's time to first token can be told apart hop by hop,
  and how late its event loop runs (server/loop_lag.py);
- each engine replica's state (``ENGINE_METRICS``), asked fresh at each scrape and labelled
  with the replica's index (``replica="0"``, …): its gauges and counters since it started,
  so a restarted engine shows as a counter reset, which Prometheus handles.

One ``ServerMetrics`` per server process, owned by the engine pool that routes its requests
(server/engine_pool.py): the latencies are this server's, whichever replica served them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextvars import ContextVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from protocol import EngineStats, RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# No "_created" series beside each counter and histogram: vLLM's dashboards do not read
# them, and they double the text.
disable_created_metrics()

# vLLM's buckets for the same histograms, so that its dashboards read these alike; time to
# first token's with a few more below 0.1 s, where a GPU's are, to tell its hops apart
# (histogram_quantile reads any buckets).
_TTFT_BUCKETS = (
    0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08,
    0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
    2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# The hops of a first token that take milliseconds unloaded (this server's, the engine's
# prefill): fine enough to tell 1 ms from 3 and 20 from 30.
_HOP_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05,
    0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
_REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

# The engine's state: (name, kind, help, EngineStats field). One table, so that every
# series is labelled alike (model, and whatever else a deployment adds).
ENGINE_METRICS = [
    ("tandem_requests_running", "gauge", "Requests decoding or prefilling.", "num_running"),
    ("tandem_requests_waiting", "gauge", "Requests queued for cache blocks.", "num_waiting"),
    ("tandem_requests_finished", "counter", "Requests finished or aborted.", "num_finished"),
    (
        "tandem_prompt_tokens",
        "counter",
        "Prompt tokens computed (prefix-cache hits excluded).",
        "num_prompt_tokens",
    ),
    (
        "tandem_prefix_cache_hit_tokens",
        "counter",
        "Prompt tokens found in the prefix cache.",
        "num_cached_prompt_tokens",
    ),
    ("tandem_generation_tokens", "counter", "Tokens generated.", "num_generated_tokens"),
    ("tandem_preemptions", "counter", "Requests preempted for cache.", "num_preemptions"),
    # vLLM's spec_decode_num_draft_tokens and _num_accepted_tokens: their ratio is the
    # acceptance rate.
    (
        "tandem_spec_decode_num_draft_tokens",
        "counter",
        "Draft tokens verified (speculative decoding).",
        "num_draft_tokens",
    ),
    (
        "tandem_spec_decode_num_accepted_tokens",
        "counter",
        "Draft tokens accepted (speculative decoding).",
        "num_accepted_tokens",
    ),
    ("tandem_kv_cache_blocks", "gauge", "KV cache blocks in all.", "num_total_blocks"),
    (
        "tandem_kv_cache_free_blocks",
        "gauge",
        "KV cache blocks no request holds.",
        "num_free_blocks",
    ),
]


# When the HTTP request being handled reached this server (time.monotonic()), set by
# HttpStatusCounter, the outermost middleware: the handlers' tasks inherit it.
_ARRIVED: ContextVar[float | None] = ContextVar("tandem_request_arrived", default=None)


class EngineCollector(Collector):
    """One scrape's engine series, one sample per replica (labelled ``replica``, by index); a
    replica with no stats (it did not answer) has only its ``tandem_engine_up`` at 0."""

    def __init__(self, replicas: list[EngineStats | None]) -> None:
        self.replicas = replicas

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "tandem_engine_up",
            "Whether the engine replica answered this scrape.",
            labels=["replica"],
        )
        for index, stats in enumerate(self.replicas):
            up.add_metric([str(index)], 0 if stats is None else 1)
        yield up
        answering = [
            (str(index), stats) for index, stats in enumerate(self.replicas) if stats is not None
        ]
        if not answering:
            return
        for name, kind, help_text, field in ENGINE_METRICS:
            family_type = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            family = family_type(name, help_text, labels=["model", "replica"])
            for index, stats in answering:
                family.add_metric([stats.model_name, index], getattr(stats, field))
            yield family


class ServerMetrics:
    """This server's histograms and counters, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.model_name = ""  # set at the engine's handshake
        labels = ["model_name"]
        self.time_to_first_token = Histogram(
            "tandem:time_to_first_token_seconds",
            "Seconds from sending a request to the engine to its first token.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "tandem:inter_token_latency_seconds",
            "Seconds between a request's successive token outputs.",
            labels,
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e_request_latency = Histogram(
            "tandem:e2e_request_latency_seconds",
            "Seconds from sending a request to the engine to its end.",
            labels,
            buckets=_REQUEST_BUCKETS,
            registry=self.registry,
        )
        # Finer than vLLM's below 0.3 s: with --max-queued-requests 0 it is milliseconds.
        self.request_queue_time = Histogram(
            "tandem:request_queue_time_seconds",
            "Seconds a request waited in the engine before its first step.",
            labels,
            buckets=_HOP_BUCKETS[:16] + _REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.request_prefill_time = Histogram(
            "tandem:request_prefill_time_seconds",
            "Seconds from a request's first step in the engine to its first token's output.",
            labels,
            buckets=_HOP_BUCKETS,
            registry=self.registry,
        )
        self.request_arrival_to_engine = Histogram(
            "tandem:request_arrival_to_engine_seconds",
            "Seconds from a request's arrival at this server to its send to the engine "
            "(its body read, its prompt rendered and tokenized, waits for this server).",
            labels,
            buckets=_HOP_BUCKETS,
            registry=self.registry,
        )
        self.first_token_to_client = Histogram(
            "tandem:first_token_to_client_seconds",
            "Seconds from a request's first token's arrival from the engine to its handler "
            "passing the text on (streamed: written to the client's connection).",
            labels,
            buckets=_HOP_BUCKETS,
            registry=self.registry,
        )
        self.event_loop_lag = Histogram(
            "tandem:event_loop_lag_seconds",
            "Seconds this server's event loop ran a task later than asked, sampled 20 times a "
            "second (every request's hops through this server wait in that loop).",
            labels,
            buckets=_HOP_BUCKETS,
            registry=self.registry,
        )
        self.request_success = Counter(
            "tandem:request_success",
            "Engine requests ended, by finish reason (stop, length, abort; error: refused "
            "or lost with the engine).",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.http_requests = Counter(
            "tandem:http_requests",
            "HTTP responses, by method and status.",
            [*labels, "method", "status"],
            registry=self.registry,
        )

    def request(self) -> RequestTimer:
        """The clock of one engine request, started now."""
        return RequestTimer(self)

    def render(self, replicas: list[EngineStats | None]) -> bytes:
        """The exposition text: this server's series, then each engine replica's."""
        engine = CollectorRegistry()
        engine.register(EngineCollector(replicas))
        return generate_latest(self.registry) + generate_latest(engine)


class RequestTimer:
    """Observes one engine request's latencies as its outputs arrive; started as the request
    is sent to the engine."""

    __slots__ = (
        "_first_text_passed",
        "_first_token",
        "_inter_token_latency",
        "_last",
        "_metrics",
        "_start",
    )

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        # Its labelled child found once: an output arrives per token and step.
        self._inter_token_latency = metrics.inter_token_latency.labels(metrics.model_name)
        self._start = time.monotonic()
        self._first_token: float | None = None  # when its first token arrived
        self._last: float | None = None  # when its last token arrived
        self._first_text_passed = False
        arrived = _ARRIVED.get()
        if arrived is not None:  # None: not sent from an HTTP request's handler
            metrics.request_arrival_to_engine.labels(metrics.model_name).observe(
                self._start - arrived
            )

    def output(self, output: RequestOutput) -> None:
        metrics, model = self._metrics, self._metrics.model_name
        if output.queue_time is not None:
            metrics.request_queue_time.labels(model).observe(output.queue_time)
        if output.prefill_time is not None:
            metrics.request_prefill_time.labels(model).observe(output.prefill_time)
        if not output.new_token_ids:
            return
        now = time.monotonic()
        if self._last is None:
            self._first_token = now
            metrics.time_to_first_token.labels(model).observe(now - self._start)
        else:
            self._inter_token_latency.observe(now - self._last)
        self._last = now

    def text_passed(self) -> None:
        """The request's handler passed text on (streamed: wrote it to the connection); the
        first time, how long after the first token's arrival."""
        if self._first_text_passed or self._first_token is None:
            return
        self._first_text_passed = True
        self._metrics.first_token_to_client.labels(self._metrics.model_name).observe(
            time.monotonic() - self._first_token
        )

    def finish(self, reason: str) -> None:
        model = self._metrics.model_name
        self._metrics.e2e_request_latency.labels(model).observe(time.monotonic() - self._start)
        self._metrics.request_success.labels(model, reason).inc()


class HttpStatusCounter:
    """ASGI middleware: counts every response by method and status, and notes when each
    request arrived (``RequestTimer``)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        _ARRIVED.set(time.monotonic())

        async def counted_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.http_requests.labels(
                    self.metrics.model_name, scope["method"], str(message["status"])
                ).inc()
            await send(message)

        await self.app(scope, receive, counted_send)
