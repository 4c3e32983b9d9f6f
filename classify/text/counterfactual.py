"""Counterfactual pairs: IMDB reviews that people edited, with as few changes as they could, so that the label flips
(Kaushik et al. 2020, ``../shared/imdb-counterfactual/``: columns text, label, pair, kind = original | revised).

Two uses, kept apart by a fixed rule on the pair id:

* training (``classify.train --counterfactual``): the pairs outside the held-out part, both texts, teach the model
  that the edited words decide the label (a bag of n-grams that memorised the original cannot tell them apart);
* measuring (``classify.evaluate --counterfactual``): the held-out pairs (``pair % HOLDOUT_EVERY == 0``, a quarter).
  Their originals are IMDB training reviews, as in the public contrast sets of edited IMDB reviews, so accuracy
  on their revisions asks what those sets ask: does the model read the edit, or recognise the review it was
  trained on? Their revisions are never trained on.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ClassifyError
from .data import Examples, load_split, normalize

HOLDOUT_EVERY = 4          # pair ids divisible by this are held out for measuring
FILE = "train.parquet"
_SENTENCE = re.compile(r"[^.!?]+(?:[.!?]+|$)")   # a trailing fragment without its mark is a sentence too


def edited_passages(original: str, revised: str) -> list[tuple[str, str]]:
    """The passages a person rewrote to flip a review's label: each run of the original's sentences (normalised)
    that the revision replaced, beside the sentences that replaced it. A passage that is the whole of both texts
    is left out (it is the pair itself), and so are sentences only added or only deleted, which have no
    counterpart; what is left keeps the pairs parallel."""
    a, b = ([s.strip() for s in _SENTENCE.findall(normalize(t)) if s.strip()] for t in (original, revised))
    return [(" ".join(a[i1:i2]), " ".join(b[j1:j2]))
            for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes()
            if tag == "replace" and (i2 - i1, j2 - j1) != (len(a), len(b))]


@dataclass
class Pairs:
    """Counterfactual pairs: ``original`` and ``revised`` are parallel (row i of each is one pair)."""

    ids: list[int]
    original: Examples
    revised: Examples

    def __len__(self) -> int:
        return len(self.ids)

    def texts(self) -> Examples:
        """Both texts of every pair, originals first."""
        return Examples(self.original.texts + self.revised.texts, self.original.labels + self.revised.labels)

    def passages(self) -> "Pairs":
        """The pairs of edited passages (``edited_passages``) of every pair, each side under its text's label:
        short texts in which nearly every word is one a person changed to flip the label."""
        rows = [(pair, o, r, o_label, r_label)
                for pair, o_text, r_text, o_label, r_label in zip(self.ids, self.original.texts, self.revised.texts,
                                                                   self.original.labels, self.revised.labels)
                for o, r in edited_passages(o_text, r_text)]
        ids, o, r, o_labels, r_labels = (list(column) for column in zip(*rows)) if rows else ([], [], [], [], [])
        return Pairs(ids, Examples(o, o_labels), Examples(r, r_labels))

    def by_original(self, texts: list[str]) -> tuple["Pairs", "Pairs"]:
        """(the pairs whose original is one of ``texts``, compared normalised; the others)."""
        seen = {normalize(t) for t in texts}
        inside = [normalize(t) in seen for t in self.original.texts]
        return self._subset(inside), self._subset([not x for x in inside])

    def _subset(self, keep: list[bool]) -> "Pairs":
        rows = [i for i, k in enumerate(keep) if k]
        return Pairs([self.ids[i] for i in rows],
                     *(Examples([e.texts[i] for i in rows], [e.labels[i] for i in rows])
                       for e in (self.original, self.revised)))


def load_pairs(path: str | Path, held_out: bool) -> Pairs:
    """The held-out pairs (``held_out``) or the others, from a folder holding ``train.parquet`` or from the file."""
    path = Path(path).expanduser()
    file = path / FILE if path.is_dir() else path
    if not file.is_file():
        raise ClassifyError(f"counterfactual pairs not found: {file} (a folder with {FILE}: text, label, pair, kind)")
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(file, columns=["text", "label", "pair", "kind"]).to_pydict()
    except Exception as err:  # pyarrow raises several types for a missing column or a damaged file
        raise ClassifyError(f"cannot read counterfactual pairs from {file}: {str(err).splitlines()[0]}") from None
    load_split(str(file))  # the same checks as any labelled file: text present, labels 0/1
    rows: dict[int, dict[str, tuple[str, int]]] = {}
    for text, label, pair, kind in zip(table["text"], table["label"], table["pair"], table["kind"]):
        rows.setdefault(int(pair), {})[kind] = (text, int(label))
    ids = sorted(p for p, r in rows.items() if "original" in r and "revised" in r and (p % HOLDOUT_EVERY == 0) == held_out)
    if not ids:
        raise ClassifyError(f"{file} holds no complete {'held-out ' if held_out else ''}original/revised pairs")
    original = Examples([rows[p]["original"][0] for p in ids], [rows[p]["original"][1] for p in ids])
    revised = Examples([rows[p]["revised"][0] for p in ids], [rows[p]["revised"][1] for p in ids])
    return Pairs(ids, original, revised)
