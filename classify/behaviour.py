"""A behavioural test suite for sentiment, CheckList-style (Ribeiro et al. 2020): what people type, not IMDB.

A benchmark number on 230-word reviews says little about "It was not boring at all." This suite generates short
sentences from templates and word lists, grouped by capability, and reports each capability's failure rate:

* minimum functionality (``kind="mft"``): each sentence has a label; a failure is a wrong label
  (vocabulary, negated positive, negated negative, negation at the end, contrast with "but", a closing verdict
  after mixed remarks, "used to ... but now");
* invariance (``kind="inv"``): each case is a sentence and a perturbation that must not change the answer (another
  name, upper/lower case, punctuation, a typo); a failure is a changed label.

It is a test set: nothing here is ever trained or tuned on, neither its sentences nor its templates.
``classify.evaluate`` runs it on every report (a section of report.md and metrics.json) for the model, each of its
branches alone and the baselines; ``experiments/behaviour.py`` records it for several runs side by side.
The cases are the same on every machine: sampled with a fixed seed from the template x word products.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import product

import numpy as np

NEG, POS = 0, 1
CASES_PER_CAPABILITY = 200

POSITIVE_ADJ = ("good", "great", "excellent", "wonderful", "amazing", "brilliant", "fantastic", "superb",
                "enjoyable", "beautiful", "delightful", "charming", "moving", "funny", "entertaining", "gripping",
                "impressive", "outstanding", "memorable", "fun")
NEGATIVE_ADJ = ("bad", "terrible", "awful", "boring", "dull", "horrible", "poor", "weak", "disappointing",
                "mediocre", "stupid", "pointless", "lame", "tedious", "forgettable", "painful", "predictable",
                "annoying", "ridiculous", "bland")
POSITIVE_VERB = ("love", "like", "enjoy", "admire", "adore", "recommend", "appreciate")
NEGATIVE_VERB = ("hate", "dislike", "despise", "detest", "regret")
THINGS = ("movie", "film", "show", "series", "sequel", "story", "picture", "documentary")
ASPECTS = ("acting", "plot", "script", "ending", "soundtrack", "direction", "dialogue", "cast", "pacing",
           "cinematography")
NAMES = ("Anna", "John", "Maria", "David", "Sofia", "James", "Emma", "Ahmed", "Chen", "Olga", "Pedro", "Aisha",
         "Lucas", "Hannah", "Kenji", "Fatima", "Michael", "Priya", "Tom", "Elena")


@dataclass
class Capability:
    """One capability: its cases, and how a failure is defined."""

    name: str
    kind: str                       # "mft": labelled sentences; "inv": pairs whose answers must agree
    description: str
    texts: list[str]                # mft: the sentences; inv: the originals
    labels: list[int] = field(default_factory=list)        # mft only
    perturbed: list[str] = field(default_factory=list)     # inv only, parallel to ``texts``


_AN = re.compile(r"\b([Aa]) ([aeiou])")   # "a amazing film" -> "an amazing film"


def _fill(templates: list[tuple[str, int]], slots: dict[str, tuple[str, ...]], rng: random.Random,
          n: int) -> tuple[list[str], list[int]]:
    """Up to ``n`` distinct sentences from ``templates`` ((text with {slot}s, label)), slots filled from ``slots``;
    sampled evenly over the templates, in a seeded order."""
    texts, labels = [], []
    per_template = -(-n // len(templates))
    for template, label in templates:
        names = [s for s in slots if "{" + s + "}" in template]
        combos = [c for c in product(*(slots[s] for s in names)) if len(set(c)) == len(c)]  # two aspects differ
        rng.shuffle(combos)
        for combo in combos[:per_template]:
            texts.append(_AN.sub(r"\1n \2", template.format(**dict(zip(names, combo)))))
            labels.append(label)
    order = list(range(len(texts)))
    rng.shuffle(order)
    return [texts[i] for i in order[:n]], [labels[i] for i in order[:n]]


def _typo(text: str, rng: random.Random) -> str:
    """Swap two different adjacent letters inside one word of four letters or more (a typing slip)."""
    words = text.split(" ")
    spots = [(i, j) for i, w in enumerate(words) if sum(c.isalpha() for c in w) >= 4
             for j in range(len(w) - 1) if w[j].isalpha() and w[j + 1].isalpha() and w[j] != w[j + 1]]
    i, j = rng.choice(spots)
    w = words[i]
    words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


def build_suite(cases: int = CASES_PER_CAPABILITY, seed: int = 0) -> list[Capability]:
    """The suite's capabilities, each with at most ``cases`` cases (the same for the same arguments)."""
    rng = random.Random(seed)
    words = {"pos": POSITIVE_ADJ, "neg": NEGATIVE_ADJ, "pv": POSITIVE_VERB, "nv": NEGATIVE_VERB, "thing": THINGS,
             "aspect": ASPECTS, "aspect2": ASPECTS, "name": NAMES}
    out: list[Capability] = []

    def mft(name: str, description: str, templates: list[tuple[str, int]]) -> None:
        texts, labels = _fill(templates, words, rng, cases)
        out.append(Capability(name, "mft", description, texts, labels))

    mft("vocabulary", "plain sentiment words", [
        ("The {thing} was {pos}.", POS), ("The {thing} was {neg}.", NEG),
        ("What a {pos} {thing}.", POS), ("What a {neg} {thing}.", NEG),
        ("I {pv} this {thing}.", POS), ("I {nv} this {thing}.", NEG),
        ("The {aspect} is {pos}.", POS), ("The {aspect} is {neg}.", NEG)])
    mft("negated positive", "a positive word negated is negative", [
        ("The {thing} was not {pos}.", NEG), ("This {thing} isn't {pos}.", NEG),
        ("I did not {pv} this {thing}.", NEG), ("I don't {pv} this {thing}.", NEG),
        ("The {aspect} was never {pos}.", NEG), ("It is not a {pos} {thing}.", NEG),
        ("I can't say the {aspect} was {pos}.", NEG), ("The {thing} wasn't {pos} at all.", NEG)])
    mft("negated negative", "a negative word negated is positive", [
        ("The {thing} was not {neg}.", POS), ("This {thing} isn't {neg}.", POS),
        ("It was not {neg} at all.", POS), ("I don't {nv} this {thing}.", POS),
        ("The {aspect} was never {neg}.", POS), ("It is not a {neg} {thing}.", POS),
        ("I didn't find the {thing} {neg} at all.", POS), ("The {thing} wasn't {neg} in the least.", POS)])
    mft("negation at the end", "the verdict is negated in the last words", [
        ("I thought the {thing} would be {pos}, but it wasn't.", NEG),
        ("I thought the {thing} would be {neg}, but it wasn't.", POS),
        ("Everyone said the {aspect} was {pos}. It was not.", NEG),
        ("Everyone said the {aspect} was {neg}. It was not.", POS)])
    mft("contrast with but", "the clause after 'but' carries the verdict", [
        ("The {aspect} was {neg}, but the {thing} was {pos}.", POS),
        ("The {aspect} was {pos}, but the {thing} was {neg}.", NEG),
        ("I expected a {neg} {thing}, but it was {pos}.", POS),
        ("I expected a {pos} {thing}, but it was {neg}.", NEG)])
    mft("closing verdict", "mixed remarks, then an overall verdict", [
        ("The {aspect} was {pos} and the {aspect2} was {neg}. Overall, a {pos} {thing}.", POS),
        ("The {aspect} was {pos} and the {aspect2} was {neg}. Overall, a {neg} {thing}.", NEG),
        ("Some of the {aspect} was {neg}, some of it {pos}. In the end I {pv} this {thing}.", POS),
        ("Some of the {aspect} was {pos}, some of it {neg}. In the end I {nv} this {thing}.", NEG)])
    mft("used to, but now", "a change of mind: the present counts", [
        ("I used to {nv} this {thing}, but now I {pv} it.", POS),
        ("I used to {pv} this {thing}, but now I {nv} it.", NEG),
        ("I used to think this {thing} was {neg}, but now I think it is {pos}.", POS),
        ("I used to think this {thing} was {pos}, but now I think it is {neg}.", NEG)])

    bases, _ = _fill([("{name} said the {thing} was {pos}.", POS), ("{name} said the {thing} was {neg}.", NEG),
                      ("{name} and I thought the {aspect} was {pos}.", POS),
                      ("{name} and I thought the {aspect} was {neg}.", NEG)], words, rng, cases)
    sentences, _ = _fill([("The {thing} was {pos}.", POS), ("The {thing} was {neg}.", NEG),
                          ("I {pv} the {aspect} of this {thing}.", POS), ("I {nv} the {aspect} of this {thing}.", NEG),
                          ("What a {pos} {thing}, the {aspect} was {pos}.", POS),
                          ("What a {neg} {thing}, the {aspect} was {neg}.", NEG)], words, rng, cases)

    def other_name(text: str) -> str:
        name = text.split(" ")[0]
        return text.replace(name, rng.choice([n for n in NAMES if n != name]), 1)

    def inv(name: str, description: str, texts: list[str], perturb: Callable[[str], str]) -> None:
        out.append(Capability(name, "inv", description, texts, perturbed=[perturb(t) for t in texts]))

    inv("names", "another person's name does not change the answer", bases, other_name)
    inv("case", "upper or lower case does not change the answer", sentences,
        lambda t: t.upper() if rng.random() < 0.5 else t.lower())
    inv("punctuation", "end punctuation does not change the answer", sentences,
        lambda t: t.rstrip(".") + rng.choice(["", "!", "!!!", " ...", "?!"]))
    inv("typos", "one swapped pair of letters does not change the answer", sentences, lambda t: _typo(t, rng))
    return out


def suite_texts(suite: list[Capability]) -> list[str]:
    """Every text the suite needs predictions for, in a fixed order (``score`` reads them back in it)."""
    return [t for c in suite for t in (c.texts + c.perturbed)]


def score(suite: list[Capability], predicted: np.ndarray, examples: int = 3) -> dict[str, dict]:
    """Failure rates per capability from ``predicted`` (the label of each of ``suite_texts``, in order):
    {name: {kind, description, cases, failures, failure_rate, examples: a few failing cases}}."""
    out: dict[str, dict] = {}
    at = 0
    for c in suite:
        n = len(c.texts)
        first = predicted[at: at + n]
        at += n
        if c.kind == "mft":
            failed = np.flatnonzero(first != np.asarray(c.labels))
            shown = [{"text": c.texts[i], "expected": int(c.labels[i]), "predicted": int(first[i])}
                     for i in failed[:examples]]
        else:
            second = predicted[at: at + n]
            at += n
            failed = np.flatnonzero(first != second)
            shown = [{"text": c.texts[i], "perturbed": c.perturbed[i], "predicted": int(first[i]),
                      "predicted_perturbed": int(second[i])} for i in failed[:examples]]
        out[c.name] = {"kind": c.kind, "description": c.description, "cases": n, "failures": int(len(failed)),
                       "failure_rate": len(failed) / n, "examples": shown}
    return out


def summary(scores: dict[str, dict]) -> dict[str, float]:
    """Overall failure rates: over all cases, over the labelled (mft) cases, and over the invariance cases."""
    def rate(kinds: tuple[str, ...]) -> float:
        chosen = [s for s in scores.values() if s["kind"] in kinds]
        return sum(s["failures"] for s in chosen) / max(1, sum(s["cases"] for s in chosen))

    return {"all": rate(("mft", "inv")), "mft": rate(("mft",)), "inv": rate(("inv",))}
