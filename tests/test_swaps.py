"""Swapped reviews (text.swaps): polar words exchanged for their nearest words of the other polarity, under the other
label; and --swapped-reviews, which trains the transformer on them."""

import json

import numpy as np
import pytest
from conftest import TINY_MODEL_ARGS

from classify.errors import ClassifyError
from classify.models import ClassifierConfig
from classify.text.swaps import antonyms, log_count_ratios, swapped_reviews
from classify.train import main
from classify.train_config import TrainConfig
from classify.training_texts import TransformerExamples, training_parts
from classify.text.windows import Elision

# A toy vocabulary: 1 "great", 2 "awful", 3 "superb", 4 "dull", 5 "plot", 6 "actor", 7 ".", 8 "fine".
GREAT, AWFUL, SUPERB, DULL, PLOT, ACTOR, STOP, FINE = range(1, 9)


def test_log_count_ratios_count_each_review_once_per_word_against_the_peer_formula():
    ids = [np.array([GREAT, GREAT, PLOT]), np.array([GREAT, ACTOR]), np.array([AWFUL, PLOT]), np.array([PLOT])]
    labels = [1, 1, 0, 0]
    ratio, docs = log_count_ratios(ids, labels, 9)
    holding = {GREAT: (0, 2), AWFUL: (1, 0), PLOT: (2, 1), ACTOR: (0, 1), DULL: (0, 0)}   # (negative, positive) reviews
    for word, (neg, pos) in holding.items():
        assert ratio[word] == pytest.approx(np.log((pos + 1) / 3) - np.log((neg + 1) / 3))
        assert docs[word] == neg + pos
    assert ratio[GREAT] > 0 > ratio[AWFUL] and ratio[DULL] == 0


def polar_setup():
    """Vectors where great ~ awful and superb ~ dull (each pair near, the pairs apart), plot and actor elsewhere;
    ratios: great, superb positive; awful, dull negative; plot, actor and "." near zero, "fine" weakly positive."""
    vectors = np.zeros((9, 4))
    vectors[[GREAT, AWFUL]] = [[1, 0.2, 0, 0], [1, -0.2, 0, 0]]
    vectors[[SUPERB, DULL]] = [[0, 1, 0.3, 0], [0.1, 1, -0.3, 0]]
    vectors[[PLOT, ACTOR, STOP, FINE]] = [[0, 0, 0, 1], [0, 0, 0.1, 1], [0, 0, 1, 0], [0.9, 0, 0, 0.1]]
    ratio = np.array([0, 2.0, -2.0, 1.5, -1.5, 0.1, -0.1, 3.0, 0.3])
    docs = np.full(9, 100.0)
    words = np.ones(9, dtype=bool)
    words[[0, STOP]] = False   # the padding id and punctuation are no words
    return vectors, ratio, docs, words


def test_each_polar_word_gets_the_nearest_polar_word_of_the_other_sign():
    vectors, ratio, docs, words = polar_setup()
    partner = antonyms(vectors, ratio, docs, words, min_ratio=0.7, min_docs=30, min_similarity=0.35)
    assert partner[GREAT] == AWFUL and partner[AWFUL] == GREAT
    assert partner[SUPERB] == DULL and partner[DULL] == SUPERB
    # Not polar enough ("fine", though near "great"), not a word ("."), or neutral: no partner.
    assert partner[FINE] == partner[STOP] == partner[PLOT] == partner[ACTOR] == partner[0] == -1


def test_a_partner_too_far_or_too_rare_is_none():
    vectors, ratio, docs, words = polar_setup()
    vectors[AWFUL] = [0, 0, -1, -1]   # awful now far from every positive word
    docs[SUPERB] = 5                  # and superb held by too few reviews to trust its ratio
    partner = antonyms(vectors, ratio, docs, words, min_ratio=0.7, min_docs=30, min_similarity=0.25)
    assert partner[GREAT] == DULL            # the nearest negative word left, at a cosine of 0.28
    assert partner[AWFUL] == -1              # no positive word near enough
    assert partner[SUPERB] == -1 and partner[DULL] == GREAT


def test_swapped_reviews_exchange_the_polar_words_and_flip_the_label_where_the_ratios_then_read_the_other_label():
    vectors, ratio, docs, words = polar_setup()
    partner = antonyms(vectors, ratio, docs, words)
    ratio[STOP] = 0.0   # punctuation reads neither way here
    reviews = [np.array([PLOT, GREAT, ACTOR, SUPERB, STOP], dtype=np.int32),   # positive, all its polarity swappable
               np.array([ACTOR, AWFUL, PLOT, STOP], dtype=np.int32),           # negative, ditto
               np.array([PLOT, FINE, GREAT, STOP], dtype=np.int32),            # positive, but "fine" has no partner
               np.array([PLOT, GREAT, STOP], dtype=np.int32)]                  # labelled negative, reads positive
    ids, labels = swapped_reviews(reviews, [1, 0, 1, 0], partner, ratio, margin=1.5)
    assert labels == [0, 1, 0]
    np.testing.assert_array_equal(ids[0], [PLOT, AWFUL, ACTOR, DULL, STOP])
    np.testing.assert_array_equal(ids[1], [ACTOR, GREAT, PLOT, STOP])
    np.testing.assert_array_equal(ids[2], [PLOT, FINE, AWFUL, STOP])   # 0.1 + 0.3 - 2.0: -1.6, past the margin
    assert all(x.dtype == np.int32 for x in ids)
    # A higher margin drops the copy whose unswapped "fine" holds it nearer the middle; a review its ratios read
    # against its own label (the fourth) is never copied.
    ids, labels = swapped_reviews(reviews, [1, 0, 1, 0], partner, ratio, margin=1.8)
    assert labels == [0, 1]


def test_the_swapped_part_is_seen_as_often_as_the_setting_says():
    config = TrainConfig(data="unused", swapped_reviews=2, short_texts=False, train_max_len=None)
    reviews = ([np.array([1, 2, 3])], [1])
    swaps = ([np.array([1, 4, 3])], [0])
    empty = ([], [])
    parts = training_parts(config, reviews, empty, empty, empty, swaps=swaps)
    examples = TransformerExamples.build(parts, [], np.zeros((0, 2)), config, set(), Elision(frozenset(), frozenset(), None, None, None, frozenset()))
    assert [x.tolist() for x in examples.ids] == [[1, 2, 3], [1, 4, 3], [1, 4, 3]]
    assert list(examples.targets) == [1, 0, 0]
    config.swapped_reviews = 0
    examples = TransformerExamples.build(training_parts(config, reviews, empty, empty, empty, swaps=swaps), [],
                                         np.zeros((0, 2)), config, set(), Elision(frozenset(), frozenset(), None, None, None, frozenset()))
    assert [x.tolist() for x in examples.ids] == [[1, 2, 3]]


def test_swapped_reviews_train_the_transformer_are_recorded_and_need_two_classes(parquet_data, tmp_path):
    out = tmp_path / "run"
    assert main(["--data", str(parquet_data), "--output", str(out), "--max-steps", "1", "--no-test",
                 "--swapped-reviews", "1", *TINY_MODEL_ARGS]) == 0
    assert json.loads((out / "config.json").read_text())["train"]["swapped_reviews"] == 1
    with pytest.raises(ClassifyError, match="--swapped-reviews .* two classes"):
        TrainConfig(data="unused", swapped_reviews=1).validate(ClassifierConfig(vocab_size=100, num_classes=3))
