"""How the server batches and bounds requests: the flags of ``python -m classify.serve``.

Kept free of web-framework imports so that ``--help`` and flag errors work without the serve extra.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..errors import ClassifyError


@dataclass(frozen=True)
class Limits:
    max_batch: int = 64           # texts the worker gathers into one batch; 1 = no batching (one request at a time)
    max_batch_tokens: int = 2048  # padded tokens per forward pass: a batch is cut into length buckets of this size
    max_delay_ms: float = 5.0     # how long the first request of a batch waits for others to join it
    max_body_mb: float = 10.0     # request body limit (a 5 MB review still fits; it is truncated)
    max_texts: int = 256          # texts per request
    max_explain_texts: int = 8    # texts per /v1/explain request (each costs a batch of --steps passes)
    max_queue: int = 256          # texts waiting for the model; past it a request gets 503 + Retry-After
    keep_alive_s: float = 65.0    # how long an idle HTTP connection stays open

    ZERO_ALLOWED = ("max_delay_ms", "keep_alive_s")   # 0: no waiting for company / no keep-alive

    def __post_init__(self) -> None:
        for f in fields(self):
            value, zero_ok = getattr(self, f.name), f.name in self.ZERO_ALLOWED
            if value < 0 or (value == 0 and not zero_ok):
                flag = "--" + f.name.replace("_", "-")
                raise ClassifyError(f"{flag} must be {'at least 0' if zero_ok else 'positive'}, got {value}")

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 2**20)
