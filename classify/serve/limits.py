"""How the server batches and bounds requests: settings of ``python -m classify.serve``, declared as the
trainers' are (``classify.engine.config``: field ``max_batch`` is flag ``--max-batch``, with its help and check).

Kept free of web-framework imports so that ``--help`` and flag errors work without the serve extra.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.config import check_settings, non_negative, positive, setting


@dataclass(frozen=True, kw_only=True)
class Limits:
    max_batch: int = setting(64, "most texts answered together; 1 = no batching (one request at a time)",
                             check=positive)
    max_batch_tokens: int = setting(2048, "padded tokens per forward pass: a batch runs as length buckets of at "
                                          "most this many (on a CPU, padding a short review to a long one costs "
                                          "more than batching saves)", check=positive)
    max_delay_ms: float = setting(0.0, "how long the first request of a batch waits for others to join it, under "
                                       "load. 0: never; a batch is whatever waited while the previous one ran, which "
                                       "on a CPU served more requests, sooner, than a 5 ms wait "
                                       "(experiments/RESULTS.md); a wait can pay where batching gains more, as on "
                                       "a GPU", check=non_negative)
    max_body_mb: float = setting(10.0, "largest request body in MiB (larger: 413; a 5 MB review still fits, "
                                       "truncated)", check=positive)
    max_texts: int = setting(256, "most texts in one request", check=positive)
    max_explain_texts: int = setting(8, "most texts in one /v1/explain request (an explanation costs about as "
                                        "much as predicting 'steps' texts, and holds the worker meanwhile)",
                                     check=positive)
    max_queue: int = setting(256, "most texts waiting for the model (an explanation counts as texts x steps); a "
                                  "request past it is refused at once with 503 and Retry-After, so that overload "
                                  "cannot grow the wait of the requests taken without bound", check=positive)
    keep_alive_s: float = setting(65.0, "seconds an idle HTTP connection stays open (above the usual clients' "
                                        "pool expiry, so a pooled connection is not closed under a request that "
                                        "reuses it; 0: no keep-alive)", check=non_negative)

    def __post_init__(self) -> None:
        check_settings(self)

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 2**20)
