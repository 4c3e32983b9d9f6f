"""One piece of work on a second thread while the main thread goes on.

For CPU-bound steps whose kernels release the GIL (scikit-learn's liblinear, torch's ops): ``classify.train`` fits
the n-gram teacher this way beside the branch, so on two cores its stage 1 takes the longer fit's time, not the sum.
A daemon thread, not a ``ThreadPoolExecutor``: the executor's workers are joined when the interpreter exits, so a
Ctrl-C during the fit would wait minutes for it to finish; a daemon thread is dropped.
"""

from __future__ import annotations

import threading
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Background(Generic[T]):
    """``fn()`` started at once on a daemon thread named ``name``; ``result()`` waits for it and returns its value
    or raises what it raised."""

    def __init__(self, fn: Callable[[], T], name: str):
        self._value: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], T]) -> None:
        try:
            self._value = fn()
        except BaseException as err:   # handed to the thread that asks for the result
            self._error = err

    def result(self) -> T:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]
