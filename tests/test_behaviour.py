"""The behavioural suite (classify.behaviour) and the counterfactual pairs (classify.text.counterfactual)."""

from __future__ import annotations

import numpy as np
import pytest

from classify.behaviour import NEG, POS, build_suite, score, suite_texts, summary
from classify.errors import ClassifyError
from classify.text.counterfactual import HOLDOUT_EVERY, Pairs, edited_passages, load_pairs
from classify.text.data import Examples


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


def test_edited_passages_are_the_rewritten_runs_of_sentences_beside_their_rewriting():
    original = "Long and boring. The cast is fine.<br /><br />I hated it. I left early. Avoid."
    revised = "Long and gripping. The cast is fine. I loved it. I stayed to the end. Avoid nothing"
    assert edited_passages(original, revised) == [("Long and boring.", "Long and gripping."),
                                                  ("I hated it. I left early. Avoid.",
                                                   "I loved it. I stayed to the end. Avoid nothing")]
    # a one-sentence pair is its own passage, an unchanged revision has none, and an added sentence no counterpart
    assert edited_passages("Dull.", "Great.") == [] and edited_passages("Fine. Good.", "Fine. Good.") == []
    assert edited_passages("It is fine.", "It is fine. I loved it.") == []


def test_the_passages_of_pairs_keep_their_labels_and_stay_parallel():
    pairs = Pairs([1, 2, 3], Examples(["Fine. Dull.", "Bad. Sad.", "Awful. Long. Boring."], [1, 0, 0]),
                  Examples(["Fine. Fun.", "Good. Glad.", "Great. Long. Gripping."], [0, 1, 1]))
    passages = pairs.passages()   # pair 2 changed every sentence: no passage of its own
    assert passages.ids == [1, 3, 3]
    assert passages.original == Examples(["Dull.", "Awful.", "Boring."], [1, 0, 0])
    assert passages.revised == Examples(["Fun.", "Great.", "Gripping."], [0, 1, 1])


def test_missing_or_malformed_pairs_are_one_line_errors(tmp_path):
    with pytest.raises(ClassifyError, match="not found"):
        load_pairs(tmp_path, held_out=True)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a"], "label": [1]}), tmp_path / "train.parquet")
    with pytest.raises(ClassifyError, match="cannot read"):
        load_pairs(tmp_path, held_out=True)


def test_counterfactual_passages_come_beside_the_pairs_are_weighted_and_train(parquet_data, tmp_path):
    """--counterfactual-passages: the training pairs' edited passages, originals' side first, beside the pairs'
    texts; the n-gram fits weigh them by --counterfactual-passage-weight; a run trains with them and records it."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from classify.train import main
    from classify.train_config import TrainConfig
    from classify.text.windows import Elision
    from classify.training_texts import (COUNTERFACTUAL, EDIT, PASSAGE, REVIEW, TransformerExamples,
                                         counterfactual_examples, ngram_weights, training_parts)
    from conftest import TINY_MODEL_ARGS

    rows = [(f"Movie {pair} opens at night. It was {ending}", label, pair, kind) for pair in range(1, 9)
            for ending, label, kind in (("dull and slow.", 0, "original"), ("gripping.", 1, "revised"))]
    pq.write_table(pa.table(dict(zip(("text", "label", "pair", "kind"), map(list, zip(*rows))))),
                   tmp_path / "train.parquet")   # pair ids not divisible by HOLDOUT_EVERY are trained on
    config = TrainConfig(data="unused", counterfactual=str(tmp_path))
    pairs, none = counterfactual_examples(config, Examples([], []))
    config.counterfactual_passages = True
    same, passages = counterfactual_examples(config, Examples([], []))
    trained = [p for p in range(1, 9) if p % HOLDOUT_EVERY]
    assert none == Examples([], []) and same == pairs and len(pairs.texts) == 2 * len(trained)
    assert passages == Examples(["It was dull and slow."] * len(trained) + ["It was gripping."] * len(trained),
                                [0] * len(trained) + [1] * len(trained))
    # the n-gram fits count a passage --counterfactual-passage-weight, an edit --negation-edit-weight
    config.counterfactual_passage_weight, config.negation_edit_weight, config.teacher_edit_weight = 0.3, 0.01, 0.1
    kinds = np.array([REVIEW, COUNTERFACTUAL, PASSAGE, EDIT])
    assert ngram_weights(kinds, config).tolist() == [1.0, 1.0, 0.3, 0.01]
    assert ngram_weights(kinds, config, teacher=True).tolist() == [1.0, 1.0, 0.3, 0.1]
    # the transformer sees them --counterfactual-passage-repeat times (0: only the n-gram fits read them)
    config.counterfactual_passage_repeat, config.short_texts, config.train_max_len = 2, False, None
    empty = ([], [])
    passages = ([np.array([3]), np.array([4])], [0, 1])
    parts = training_parts(config, ([np.array([1, 2])], [1]), empty, empty, empty, passages)
    examples = TransformerExamples.build(parts, [], np.zeros((0, 2)), config, set(),
                                         Elision(frozenset(), frozenset(), None, None, None, frozenset()))
    assert [x.tolist() for x in examples.ids] == [[1, 2], [3], [4], [3], [4]]
    config.counterfactual_passage_repeat, config.counterfactual_pair_weight = 0, 1.0
    examples = TransformerExamples.build(training_parts(config, ([np.array([1, 2])], [1]), empty, empty, empty,
                                                        passages), [], np.zeros((0, 2)), config, set(),
                                         Elision(frozenset(), frozenset(), None, None, None, frozenset()))
    assert [x.tolist() for x in examples.ids] == [[1, 2]]

    out = tmp_path / "run"
    assert main(["--data", str(parquet_data), "--output", str(out), "--max-steps", "1", "--no-test",
                 "--counterfactual", str(tmp_path), "--counterfactual-passages", "--counterfactual-passage-weight",
                 "0.3", *TINY_MODEL_ARGS]) == 0
    recorded = json.loads((out / "config.json").read_text())["train"]
    assert recorded["counterfactual_passages"] is True and recorded["counterfactual_passage_weight"] == 0.3
