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

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value < 0 or (value == 0 and f.name != "max_delay_ms"):
                flag = "--" + f.name.replace("_", "-")
                raise ClassifyError(f"{flag} must be {'at least 0' if f.name == 'max_delay_ms' else 'positive'}, "
                                    f"got {value}")

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 2**20)
