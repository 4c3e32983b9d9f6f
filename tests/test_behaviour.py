"""The behavioural suite (classify.behaviour) and the counterfactual pairs (classify.text.counterfactual)."""

from __future__ import annotations

import numpy as np
import pytest

from classify.behaviour import NEG, POS, build_suite, score, suite_texts, summary
from classify.errors import ClassifyError
from classify.text.counterfactual import HOLDOUT_EVERY, load_pairs


def test_the_suite_is_the_same_every_time_and_large_enough_to_mean_something():
    suite = build_suite()
    again = build_suite()
    assert [c.texts + c.perturbed for c in suite] == [c.texts + c.perturbed for c in again]
    assert all(len(c.texts) >= 150 for c in suite)
    assert all(len(set(c.texts)) == len(c.texts) for c in suite if c.kind == "mft")   # no repeated sentence
    names = {c.name for c in suite}
    assert {"vocabulary", "negated positive", "negated negative", "negation at the end", "contrast with but",
            "closing verdict", "used to, but now", "names", "case", "punctuation", "typos"} == names


def test_labels_follow_the_capability_and_perturbations_change_only_what_they_name():
    by_name = {c.name: c for c in build_suite()}
    assert set(by_name["negated positive"].labels) == {NEG} and set(by_name["negated negative"].labels) == {POS}
    assert set(by_name["vocabulary"].labels) == {NEG, POS}
    for text, label in zip(by_name["contrast with but"].texts, by_name["contrast with but"].labels):
        assert ", but " in text and label in (NEG, POS)
    for c in (by_name[n] for n in ("names", "case", "punctuation", "typos")):
        assert len(c.perturbed) == len(c.texts) and all(a != b for a, b in zip(c.texts, c.perturbed))
    for a, b in zip(by_name["case"].texts, by_name["case"].perturbed):
        assert a.lower() == b.lower()
    for a, b in zip(by_name["typos"].texts, by_name["typos"].perturbed):
        assert sorted(a) == sorted(b) and sum(x != y for x, y in zip(a, b)) == 2   # two letters swapped
    for a, b in zip(by_name["names"].texts, by_name["names"].perturbed):
        assert a.split(" ", 1)[1] == b.split(" ", 1)[1] and a.split(" ")[0] != b.split(" ")[0]


def test_failure_rates_count_wrong_labels_and_changed_answers():
    suite = build_suite(cases=40)
    texts = suite_texts(suite)
    expected = []   # a perfect answer: each mft label, and the same answer for both sides of an invariance pair
    for c in suite:
        expected += c.labels if c.kind == "mft" else [POS] * (2 * len(c.texts))
    perfect = score(suite, np.asarray(expected))
    assert all(s["failures"] == 0 for s in perfect.values()) and summary(perfect)["all"] == 0
    always_positive = score(suite, np.full(len(texts), POS))
    for c in suite:
        wanted = sum(1 for y in c.labels if y == NEG) if c.kind == "mft" else 0
        assert always_positive[c.name]["failures"] == wanted
    # Flip the answer on every perturbed text: every invariance case fails, no mft case changes.
    flipped = np.asarray(expected).copy()
    at = 0
    for c in suite:
        at += len(c.texts)
        if c.kind == "inv":
            flipped[at: at + len(c.texts)] = NEG
            at += len(c.texts)
    rates = summary(score(suite, flipped))
    assert rates["inv"] == 1.0 and rates["mft"] == 0.0


def test_counterfactual_pairs_split_into_held_out_and_training_parts(counterfactual_data):
    held_out = load_pairs(counterfactual_data, held_out=True)
    training = load_pairs(counterfactual_data, held_out=False)
    assert all(p % HOLDOUT_EVERY == 0 for p in held_out.ids) and all(p % HOLDOUT_EVERY for p in training.ids)
    assert sorted(held_out.ids + training.ids) == list(range(40))
    for pairs in (held_out, training):
        assert [1 - y for y in pairs.original.labels] == pairs.revised.labels
        assert pairs.texts().texts == pairs.original.texts + pairs.revised.texts


def test_missing_or_malformed_pairs_are_one_line_errors(tmp_path):
    with pytest.raises(ClassifyError, match="not found"):
        load_pairs(tmp_path, held_out=True)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a"], "label": [1]}), tmp_path / "train.parquet")
    with pytest.raises(ClassifyError, match="cannot read"):
        load_pairs(tmp_path, held_out=True)
