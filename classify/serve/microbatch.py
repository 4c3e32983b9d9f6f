"""Micro-batching: one worker thread owns the model and answers the requests that arrive together
in one predict call.

The event loop only enqueues a job and awaits an asyncio future; the worker thread takes the
first waiting request, then keeps taking requests until ``max_batch`` texts are gathered or
``max_delay`` seconds have passed since it took the first, runs them all through one predict
call (length-bucketed forward passes, ``inference.classify_texts``) and hands each request its own
slice of the results. Requests that arrive while a batch runs join the next one; none waits more
than ``max_delay`` for company. ``max_batch=1`` turns batching off (one request at a time).

The server's default window is 0: the worker never idles while a request waits, and a batch is
whatever queued while the previous one ran, so the batch size follows the load by itself. On a CPU
that served more requests, sooner, than a 5 ms window (experiments/RESULTS.md, "Serving: no wait for
company"): with 32 clients each waiting for its answer, a window kept the worker idle while the
answers of the batch before went out and the next requests came in. A window (``max_delay > 0``)
opens only under load: when the previous batch had a single text, the next one takes what is
queued and runs at once, so a lone client pays no window (an always-open 5 ms window cut one
client's requests/s by about 40%: experiments/RESULTS.md, "Serving load test").

Back-pressure: at most ``max_queue`` texts wait for the worker. A request that would go past it is
refused at once (``Overloaded``, which the app answers 503 with Retry-After) instead of joining a
queue whose wait grows without bound: under overload the requests that are taken keep a bounded
latency, and a client learns at once that it should retry later.

Other model work (explanations, which hook the model's embeddings) runs on the same thread,
alone, so nothing ever touches the model concurrently.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

R = TypeVar("R")
T = TypeVar("T")


@dataclass
class _Job:
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    texts: Sequence[str] = ()                       # a prediction request, batched with others ...
    call: Callable[[], Any] | None = None           # ... or work that runs alone
    weight: int = 1                                 # what a call counts as against max_queue, in texts

    @property
    def size(self) -> int:
        return self.weight if self.call is not None else len(self.texts)


_STOP = object()


class Overloaded(Exception):
    """More texts are waiting for the worker than its ``max_queue``."""


@dataclass
class BatchStats:
    """What the worker has done, for /v1/model and the tests."""

    batches: int = 0
    texts: int = 0
    largest: int = 0
    rejected: int = 0                                 # requests refused past max_queue (503)
    recent: list[int] = field(default_factory=list)   # sizes of the last ``RECENT`` batches

    RECENT = 100

    def add(self, size: int) -> None:
        self.batches += 1
        self.texts += size
        self.largest = max(self.largest, size)
        self.recent = (self.recent + [size])[-self.RECENT:]


class BatchListener(Protocol):
    """What the batcher tells as it happens (the server's metrics). Told, not read at scrape time, so that
    several server processes can add up what each of theirs told (``serve.metrics``)."""

    def batch(self, size: int) -> None:
        """A batch of ``size`` texts has run (called on the worker thread)."""

    def waiting(self, texts: int) -> None:
        """``texts`` texts wait for the worker now (called with the queue's lock held: keep it short)."""

    def rejected(self) -> None:
        """A request was refused past ``max_queue``."""


class MicroBatcher(Generic[R]):
    """Runs ``predict(texts) -> one result per text`` on a worker thread, batching requests."""

    def __init__(self, predict: Callable[[list[str]], list[R]], max_batch: int, max_delay: float,
                 max_queue: int | None = None, listener: BatchListener | None = None):
        self.predict_fn, self.max_batch, self.max_delay, self.max_queue = predict, max_batch, max_delay, max_queue
        self.listener = listener
        self.stats = BatchStats()
        self._queue: queue.Queue = queue.Queue()
        self._waiting = 0                  # texts submitted and not yet taken by the worker
        self._waiting_lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, name="classify-batcher", daemon=True)

    # ------------------------------------------------------------ event-loop side
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the batch in hand, then end the thread (requests still queued get no answer: stop only
        once the server has stopped taking requests)."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    async def predict(self, texts: Sequence[str]) -> list[R]:
        """The results for ``texts``, in order, from a batch shared with whatever else is waiting."""
        return await self._submit(texts=list(texts))

    async def call(self, fn: Callable[[], T], weight: int = 1) -> T:
        """``fn()`` run on the worker thread, alone (for model work that must not overlap a batch);
        ``weight``: how many texts it counts as against ``max_queue``."""
        return await self._submit(call=fn, weight=weight)

    @property
    def waiting(self) -> int:
        """Texts waiting for the worker now."""
        return self._waiting

    def _submit(self, **job: Any) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        new = _Job(loop.create_future(), loop, **job)
        with self._waiting_lock:
            if self.max_queue is not None and self._waiting + new.size > self.max_queue and self._waiting:
                self.stats.rejected += 1
                if self.listener is not None:
                    self.listener.rejected()
                raise Overloaded(f"the server is busy: {self._waiting} texts are already waiting for the model "
                                 f"(its --max-queue is {self.max_queue}); retry in a moment")
            self._count_waiting(new.size)
        self._queue.put(new)
        return new.future

    def _take(self, job: _Job) -> _Job:
        """The worker has taken ``job`` off the queue: it no longer waits."""
        with self._waiting_lock:
            self._count_waiting(-job.size)
        return job

    def _count_waiting(self, change: int) -> None:
        """Texts waiting go up or down by ``change`` (the caller holds ``_waiting_lock``)."""
        self._waiting += change
        if self.listener is not None:
            self.listener.waiting(self._waiting)

    # ----------------------------------------------------------------- worker side
    def _work(self) -> None:
        held = None   # a job taken while gathering that could not join the batch: it goes next
        loaded = False  # did the previous batch have company? (then the window is open)
        while True:
            job = held if held is not None else self._queue.get()
            held = None
            if job is _STOP:
                return
            self._take(job)
            if job.call is not None:
                self._settle([job], job.call)
                continue
            batch, size = [job], len(job.texts)
            deadline = time.monotonic() + (self.max_delay if loaded else 0.0)
            while size < self.max_batch:
                try:
                    nxt = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if nxt is _STOP or nxt.call is not None or size + len(nxt.texts) > self.max_batch:
                    held = nxt
                    break
                batch.append(self._take(nxt))
                size += len(nxt.texts)
            texts = [t for j in batch for t in j.texts]
            loaded = len(texts) > 1
            self._settle(batch, lambda: self._predict(texts))

    def _predict(self, texts: list[str]) -> list[R]:
        results = self.predict_fn(texts)
        self.stats.add(len(texts))
        if self.listener is not None:
            self.listener.batch(len(texts))
        return results

    @staticmethod
    def _settle(jobs: list[_Job], work: Callable[[], Any]) -> None:
        """Run ``work`` and resolve each job's future: its slice of a batch's results, a call's value,
        or the exception (so one failing batch fails its requests, never the worker)."""
        try:
            result, error = work(), None
        except Exception as err:  # noqa: BLE001 - handed to the requests, which answer 500
            result, error = None, err
        start = 0
        for job in jobs:
            if error is not None:
                outcome = error
            elif job.call is not None:
                outcome = result
            else:
                outcome, start = result[start:start + len(job.texts)], start + len(job.texts)
            try:
                job.loop.call_soon_threadsafe(_resolve, job.future, outcome, error is not None)
            except RuntimeError:
                pass  # that request's event loop is closed: nobody is waiting any more


def _resolve(future: asyncio.Future, outcome: Any, failed: bool) -> None:
    if future.done():  # the request was cancelled (client gone) meanwhile
        return
    if failed:
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
