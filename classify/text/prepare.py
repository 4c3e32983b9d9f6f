"""The first stage of inference: raw review texts -> the token ids a model reads, and what was cut.

    prepare = Preprocessing(tokenizer, max_len=512, truncation="head+tail", spelling=True)
    [p.ids for p in prepare(texts)]              # what train, evaluate, predict and serve all feed the model

Every model folder (a run, or an export for ONNX Runtime) holds what this needs: ``tokenizer.json``, and
``max_len``, ``truncation`` and ``spelling`` in ``config.json``; so every backend reads the same ids for the same
text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from tokenizers import Tokenizer

from .data import normalize
from .spelling import Speller
from .tokenize import ENCODE_CHUNK, truncate

# One text's token ids: a list from the tokenizer, or the int32 array (T,) ``Preprocessing.ids`` keeps for data sets.
TokenIds = list[int] | np.ndarray
CHARS_PER_TOKEN = 100         # characters kept per model position before tokenizing (see ``Preprocessing.clip``)
FIXES_NAMED = 5               # typing slips a note names one by one; the rest are counted


@dataclass
class Prepared:
    """One raw text, ready for the model."""

    text: str                 # the text as tokenized (after ``clip``)
    normalized: str           # ... and normalised (what the tokenizer saw; empty when only markup was left)
    ids: list[int]            # the token ids the model reads (at most ``max_len``)
    notes: list[str]          # what was truncated or read as another word, for people


@dataclass(frozen=True)
class Preprocessing:
    """Clip, normalise, tokenize, correct typing slips and truncate raw texts as a run reads them (training reads
    its reviews without the correction: ``spelling`` False)."""

    tokenizer: Tokenizer
    max_len: int
    truncation: str           # "head" | "tail" | "head+tail" (``text.tokenize.truncate``)
    spelling: bool = False    # read an unknown word one edit from a known one as that word (``text.spelling``)
    speller: Speller | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "speller", Speller.for_tokenizer(self.tokenizer) if self.spelling else None)

    def clip(self, text: str) -> tuple[str, str | None]:
        """Cut a very long review to ``CHARS_PER_TOKEN`` characters per model position before tokenizing,
        keeping the same head/tail proportions as the token truncation, so a megabyte review costs no more
        than a long one. Reviews shorter than that (every IMDB review) are untouched."""
        budget = CHARS_PER_TOKEN * self.max_len
        if len(text) <= budget:
            return text, None
        note = (f"truncated: {len(text):,} characters, of which the model read {self.max_len} tokens "
                f"({self.truncation})")
        return truncate(text, budget, self.truncation), note  # type: ignore[arg-type]  (slices characters)

    def tokens(self, normalized: list[str]) -> list[tuple[list[int], list[tuple[int, int]], list[tuple[str, str]]]]:
        """Normalised texts -> for each, all its token ids (before truncation) with typing slips corrected, each
        token's character span in the text, and the (written, read) pairs corrected; in one batch (in Rust, in
        parallel)."""
        out = []
        for norm, encoding in zip(normalized, self.tokenizer.encode_batch(normalized, add_special_tokens=False)):
            ids, fixes = (encoding.ids, []) if self.speller is None else \
                self.speller.correct(norm, encoding.ids, encoding.offsets)
            out.append((ids, encoding.offsets, fixes))
        return out

    def __call__(self, texts: list[str]) -> list[Prepared]:
        """Raw texts -> ``Prepared`` in input order."""
        clipped = [self.clip(text) for text in texts]
        normalized = [normalize(text) for text, _ in clipped]
        out = []
        for (text, note), norm, (full, _, fixes) in zip(clipped, normalized, self.tokens(normalized)):
            notes = [note] if note else []
            if len(full) > self.max_len and not notes:  # (a clipped review's note already says so)
                notes.append(f"truncated: the model read {self.max_len} of its {len(full)} tokens ({self.truncation})")
            if fixes:
                named = ", ".join(f"{written!r} as {read!r}" for written, read in fixes[:FIXES_NAMED])
                more = f" and {len(fixes) - FIXES_NAMED} more" if len(fixes) > FIXES_NAMED else ""
                notes.append(f"read {named}{more}")
            out.append(Prepared(text, norm, truncate(full, self.max_len, self.truncation), notes))
        return out

    def ids(self, texts: list[str]) -> list[TokenIds]:
        """Raw texts -> only the token ids (training and evaluation sets), one int32 array (T,) per text,
        ``ENCODE_CHUNK`` texts at a time: the tokenizer's Encodings of a whole split at once would cost gigabytes
        (``text.tokenize.ENCODE_CHUNK``), and Python lists of ids take 3x the memory (IMDB's 50,000 unlabelled
        reviews: 72 MB as arrays, 225 MB as lists)."""
        return [np.asarray(p.ids, dtype=np.int32)
                for start in range(0, len(texts), ENCODE_CHUNK) for p in self(texts[start: start + ENCODE_CHUNK])]
