"""``GET /metrics``: what the server has done, in Prometheus' text format (``prometheus-client``).

Each app has a registry of its own rather than the process-wide default one, so that several apps in one
process (the tests, an embedding program) count separately and never register a metric twice.

    classify_http_requests_total{endpoint,method,status}      every answer, errors included
    classify_http_errors_total{endpoint,status}               the answers with status >= 400
    classify_http_request_duration_seconds{endpoint}          latency histogram (request in to answer out)
    classify_queue_texts                                      texts waiting for the model now
    classify_batch_texts                                      texts per model batch (histogram)
    classify_rejected_requests_total                          requests refused with 503 past --max-queue
    classify_model_info{name,version,sha256}                  the model that answers (value 1)

``endpoint`` is the route (``/v1/predict``) or ``other`` for paths the server does not have, so that a
scan of random URLs cannot grow the number of series without bound.

With ``--workers N`` each request reaches one of N processes, and a scrape is one request: each process's own
numbers would make every counter jump between scrapes. So ``serve.workers`` sets ``PROMETHEUS_MULTIPROC_DIR``
(prometheus-client's multiprocess mode): every process writes its values to files there, and a scrape, whichever
process answers it, adds them up: counters and histograms over all workers, dead ones included (a counter never
goes down), and the queue over the workers alive. That mode cannot read a value at scrape time, so the batcher
tells its queue and refusals as they change (``microbatch.BatchListener``).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .service import ModelIdentity

# Latency: a lone review takes a few ms; under load, hundreds; past 10 s something is wrong.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CONTENT_TYPE = CONTENT_TYPE_LATEST
MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"   # prometheus-client reads it when imported: set it before
_LIVE_GAUGE_FILE = re.compile(r"gauge_live\w+_(\d+)\.db")   # a process's file of gauges counted while it lives


class Metrics:
    """The collectors of one app, and the text a scrape reads. It is the batcher's ``BatchListener``."""

    def __init__(self, identity: ModelIdentity):
        self.registry = CollectorRegistry()
        self.shared = os.environ.get(MULTIPROCESS_ENV)   # the folder the server's processes share, if several
        self.requests = Counter("classify_http_requests", "HTTP requests answered, by route, method and status",
                                ["endpoint", "method", "status"], registry=self.registry)
        self.errors = Counter("classify_http_errors", "HTTP answers with status >= 400, by route and status",
                              ["endpoint", "status"], registry=self.registry)
        self.latency = Histogram("classify_http_request_duration_seconds", "time from request to the end of its "
                                 "answer, by route", ["endpoint"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.batch_texts = Histogram("classify_batch_texts", "texts per batch the model ran",
                                     buckets=BATCH_BUCKETS, registry=self.registry)
        self.queue = Gauge("classify_queue_texts", "texts waiting for the model", registry=self.registry,
                           multiprocess_mode="livesum")
        self.rejections = Counter("classify_rejected_requests", "requests refused with 503 because more than "
                                  "--max-queue texts were waiting", registry=self.registry)
        # A gauge at 1 is what an Info metric writes, and unlike Info it works in multiprocess mode.
        Gauge("classify_model_info", "the model that answers", ["name", "version", "sha256"], registry=self.registry,
              multiprocess_mode="max").labels(identity.name, identity.version, identity.sha256).set(1)

    # ------------------------------------------------------------- microbatch.BatchListener
    def batch(self, size: int) -> None:
        self.batch_texts.observe(size)

    def waiting(self, texts: int) -> None:
        self.queue.set(texts)

    def rejected(self) -> None:
        self.rejections.inc()

    # ------------------------------------------------------------------------------------
    def render(self) -> bytes:
        """The exposition: this app's values or, with several processes, all of theirs added up."""
        if self.shared is None:
            return generate_latest(self.registry)
        forget_dead_processes(self.shared)
        combined = CollectorRegistry()
        MultiProcessCollector(combined, path=self.shared)
        return generate_latest(combined)

    def record(self, endpoint: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, method, str(status)).inc()
        if status >= 400:
            self.errors.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)


def forget_dead_processes(shared: str) -> None:
    """Drop the queue gauges of processes that are gone (a worker killed and replaced), so the queue adds up
    the living only; their counters stay, as counters must."""
    for file in Path(shared).glob("gauge_live*_*.db"):
        match = _LIVE_GAUGE_FILE.fullmatch(file.name)
        if match and not _alive(int(match.group(1))):
            with contextlib.suppress(FileNotFoundError):   # another process, scraped at once, removed it first
                mark_process_dead(int(match.group(1)), shared)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists. Signal 0 probes it on POSIX; elsewhere (Windows), os.kill would end it,
    so every process counts as alive there."""
    if os.name != "posix":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # it exists, under another user
        pass
    return True


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
        status, start, recorded = 500, time.perf_counter(), False

        def record() -> None:
            nonlocal recorded
            if not recorded:
                recorded = True
                self.metrics.record(endpoint, scope["method"], status, time.perf_counter() - start)

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                record()   # before the answer's last bytes leave: a client holding its answer finds it counted
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            record()   # an answer that never finished (an unhandled exception: the server's 500)
