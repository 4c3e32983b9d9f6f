"""``GET /metrics``: what the server has done, in Prometheus' text format (``prometheus-client``).

Each app has a registry of its own rather than the process-wide default one, so that several apps in one
process (the tests, an embedding program) count separately and never register a metric twice.

    classify_http_requests_total{endpoint,method,status}      every answer, errors included
    classify_http_errors_total{endpoint,status}               the answers with status >= 400
    classify_http_request_duration_seconds{endpoint}          latency histogram (request in to answer out)
    classify_queue_texts                                      texts waiting for the model now
    classify_batch_texts                                      texts per model batch (histogram)
    classify_rejected_requests_total                          requests refused with 503 past --max-queue
    classify_model_info{name,version,sha256}                  the model that answers

``endpoint`` is the route (``/v1/predict``) or ``other`` for paths the server does not have, so that a
scan of random URLs cannot grow the number of series without bound.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .microbatch import MicroBatcher
from .service import ModelIdentity

# Latency: a lone review takes a few ms; under load, hundreds; past 10 s something is wrong.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class _Rejections(Collector):
    """The batcher's count of refused requests, read at scrape time."""

    def __init__(self, batcher: MicroBatcher):
        self.batcher = batcher

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("classify_rejected_requests", "requests refused with 503 because more than "
                                  "--max-queue texts were waiting", value=self.batcher.stats.rejected)


class Metrics:
    """The collectors of one app, and the text a scrape reads."""

    def __init__(self, identity: ModelIdentity):
        self.registry = CollectorRegistry()
        self.requests = Counter("classify_http_requests", "HTTP requests answered, by route, method and status",
                                ["endpoint", "method", "status"], registry=self.registry)
        self.errors = Counter("classify_http_errors", "HTTP answers with status >= 400, by route and status",
                              ["endpoint", "status"], registry=self.registry)
        self.latency = Histogram("classify_http_request_duration_seconds", "time from request to the end of its "
                                 "answer, by route", ["endpoint"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.batch_texts = Histogram("classify_batch_texts", "texts per batch the model ran",
                                     buckets=BATCH_BUCKETS, registry=self.registry)
        Info("classify_model", "the model that answers", registry=self.registry).info(
            {"name": identity.name, "version": identity.version, "sha256": identity.sha256})

    def watch(self, batcher: MicroBatcher) -> None:
        """Read the batcher's queue depth and refusals at each scrape (it keeps them; no second count).
        Its batch sizes arrive through ``batch_texts.observe``, which the batcher calls after each batch."""
        Gauge("classify_queue_texts", "texts waiting for the model", registry=self.registry).set_function(
            lambda: batcher.waiting)
        self.registry.register(_Rejections(batcher))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def record(self, endpoint: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, method, str(status)).inc()
        if status >= 400:
            self.errors.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)


class RequestMetrics:
    """ASGI middleware: counts and times every HTTP request. Outermost of the app's middleware, so that
    refusals by the others (401, 413) count too; a request that ends in an unhandled exception counts as
    the 500 the server answers for it."""

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: Callable[[], Iterable[str]]):
        self.app, self.metrics, self.routes = app, metrics, routes
        self.known: frozenset[str] | None = None   # the app's paths, read at the first request (routes are final)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.known is None:
            self.known = frozenset(self.routes())
        endpoint = scope["path"] if scope["path"] in self.known else "other"
        status, start = 500, time.perf_counter()

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.metrics.record(endpoint, scope["method"], status, time.perf_counter() - start)
