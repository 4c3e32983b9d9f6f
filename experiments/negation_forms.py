"""How the training reviews negate, and which negations the negation edits write (``classify.text.edits``).

    python -m experiments.negation_forms --data ../shared/imdb --record

Counts, over the source's labelled training reviews (normalised, lower-cased words as ``text.edits.words`` reads
them; never the test split): what follows a copula or modal ("was not", "wasn't", "was no", "was never"; and for
an indefinite predicate, "is no" against "is not a" / "isn't a"), and what follows a pronoun at a sentence's
start ("I didn't", "I did not", "I never"). Those shares are the ones ``--negators never`` and ``varied`` write
(``text.edits.NO_SHARE``, ...). Then the forms of the negation edits ``negation_pairs`` makes from the same reviews
with each ``--negators``: how many edit texts hold "not", "n't", "no" or "never".
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from classify.text.data import load_split, normalize
from classify.text.edits import (ARTICLES, CONTRACTED, DO_BY_SUBJECT, NEGATION_FORMS, NO_PHRASES, TAKES_NOT, UNNEGATED,
                                 Lexicon, negation_pairs, sentences, words)

from . import add_results_args, results_folder
from .trainruns import experiment_meta, write_results

DO_FORMS = frozenset({"did", *DO_BY_SUBJECT.values()})   # "did", "do", "does"
DO_NEGATED = frozenset(negated for negated, plain in UNNEGATED.items() if plain in DO_FORMS)   # "didn't", ...


def how_reviews_negate(texts: list[str]) -> dict[str, int]:
    """Counts of each way of negating (or not) after a copula or modal, and after a sentence's pronoun subject."""
    counts: Counter = Counter()
    contracted = frozenset(CONTRACTED.values())
    for text in texts:
        ws = words(text)
        for w, after, then in zip(ws, ws[1:], ws[2:] + [""]):
            if w in contracted:
                counts["copula: n't + article" if after in ARTICLES else "copula: n't"] += 1
            elif w in TAKES_NOT:
                if after == "not":
                    counts["copula: not + article" if then in ARTICLES else "copula: not"] += 1
                elif after == "never":
                    counts["copula: never"] += 1
                elif after == "no" and then not in NO_PHRASES:
                    counts["copula: no"] += 1
        for sentence in sentences(text):
            ws = words(sentence)
            if len(ws) < 3 or ws[0] not in DO_BY_SUBJECT:
                continue
            if ws[1] in DO_NEGATED:
                counts["pronoun: didn't"] += 1
            elif ws[1] in DO_FORMS and ws[2] == "not":
                counts["pronoun: did not"] += 1
            elif ws[1] == "never":
                counts["pronoun: never"] += 1
    return dict(counts)


def shares(counts: dict[str, int]) -> dict[str, float]:
    """The shares ``text.edits`` uses, from ``how_reviews_negate``'s counts."""
    c = Counter(counts)
    indefinite = c["copula: not + article"] + c["copula: n't + article"]
    other = c["copula: not"] + c["copula: n't"]
    pronoun = c["pronoun: didn't"] + c["pronoun: did not"]
    return {"no for an indefinite predicate": c["copula: no"] / max(1, c["copula: no"] + indefinite),
            "never after a copula": c["copula: never"] / max(1, c["copula: never"] + other),
            "never after a pronoun": c["pronoun: never"] / max(1, c["pronoun: never"] + pronoun)}


def edit_forms(texts: list[str], labels: list[int], negators: str) -> dict[str, int]:
    """How many of ``negation_pairs``' texts hold each negation (the un-negated side counts as "none")."""
    lexicon = Lexicon.fit(texts, labels)
    made, _ = negation_pairs(texts, labels, lexicon, negators=negators)
    counts: Counter = Counter()
    for text in made:
        ws = set(words(text))
        counts[next((form for form, hit in (("never", "never" in ws), ("no", "no" in ws), ("not", "not" in ws),
                                             ("n't", any(w.endswith("n't") for w in ws))) if hit), "none")] += 1
    return dict(counts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m experiments.negation_forms",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="a source with a labelled train split (../shared/imdb)")
    parser.add_argument("--name", default="negation_forms", help="the report's file name")
    add_results_args(parser, "NAME.json and .md")
    args = parser.parse_args(argv)
    train = load_split(args.data, "train")
    texts = [normalize(t) for t in train.texts]
    counts = how_reviews_negate(texts)
    record = {**experiment_meta("experiments.negation_forms", argv), "reviews": len(texts), "counts": counts,
              "shares": shares(counts),
              "edits": {negators: edit_forms(texts, train.labels, negators) for negators in NEGATION_FORMS}}
    lines = [f"# How {len(texts):,} training reviews negate, and what the negation edits write", "",
             f"Command: `{record['command']}` ({record['date']}).", "", "| form | count |", "|---|---|",
             *(f"| {form} | {n:,} |" for form, n in sorted(counts.items())), "", "| share | value |", "|---|---|",
             *(f"| {name} | {value:.1%} |" for name, value in record["shares"].items()), "",
             "| `--negators` | edit texts by the negation they hold |", "|---|---|",
             *(f"| {negators} | " + ", ".join(f"{form} {n:,}" for form, n in sorted(forms.items())) + " |"
               for negators, forms in record["edits"].items())]
    write_results(results_folder(args), args.name, record, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
