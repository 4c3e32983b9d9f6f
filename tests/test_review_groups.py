"""Grouped validation: reviews of one movie stay on one side of the split."""

from __future__ import annotations

import random
import string

import numpy as np

from classify.data import training_split
from classify.review_groups import grouped_split, review_groups

FILLER = "the movie film plot actor story scene was and it of this to in with director music cast".split()


def movie_reviews(movies: int = 240, per_label: int = 3, seed: int = 0) -> tuple[list[str], list[int], list[int]]:
    """Reviews of ``movies`` movies, each mentioning its own two made-up names, listed as the aclImdb files are:
    all negative reviews movie by movie, then all positive ones. Returns (texts, labels, movie of each review)."""
    rng = random.Random(seed)
    names = [["".join(rng.choices(string.ascii_lowercase, k=9)) for _ in range(2)] for _ in range(movies)]
    texts, labels, movie_of = [], [], []
    for label, word in ((0, "awful"), (1, "great")):
        for m in range(movies):
            for _ in range(per_label):
                words = rng.choices(FILLER, k=rng.randint(10, 30)) + names[m] + [word]
                rng.shuffle(words)
                texts.append(" ".join(words))
                labels.append(label)
                movie_of.append(m)
    return texts, labels, movie_of


def sides(split: tuple[list[int], list[int]], key: list[int]) -> set[int]:
    """Keys (groups or movies) that have reviews on both sides of the split."""
    train, val = split
    return {key[i] for i in train} & {key[i] for i in val}


def test_rows_in_movie_order_are_grouped_in_blocks_and_no_group_is_split():
    texts, labels, _ = movie_reviews()
    groups, method = review_groups(texts, labels)
    assert method == "ordered"
    split = grouped_split(labels, groups, 150, seed=0)
    positives = sum(labels[i] for i in split[1])
    assert 125 <= len(split[1]) <= 150 and positives <= 75 and len(split[1]) - positives <= 75   # within quotas
    assert not sides(split, groups.tolist())
    y = np.asarray(labels)
    assert not set(groups[y == 0].tolist()) & set(groups[y == 1].tolist())   # a group holds one label


def test_shuffled_rows_are_grouped_by_shared_rare_words_and_no_movie_is_split():
    texts, labels, movie_of = movie_reviews()
    order = np.random.default_rng(0).permutation(len(texts)).tolist()
    texts, labels, movie_of = [texts[i] for i in order], [labels[i] for i in order], [movie_of[i] for i in order]
    groups, method = review_groups(texts, labels)
    assert method == "similar"
    split = grouped_split(labels, groups, 150, seed=1)
    assert not sides(split, groups.tolist())
    assert not sides(split, movie_of)              # every movie's reviews found each other
    assert 140 <= len(split[1]) <= 150
    # The same split at random shares most movies: what grouping is for.
    rng = np.random.default_rng(1)
    random_val = sorted(rng.permutation(len(texts))[:150].tolist())
    random_split = (sorted(set(range(len(texts))) - set(random_val)), random_val)
    assert len(sides(random_split, movie_of)) > 50


def test_split_is_seeded_and_training_split_chooses_it(tmp_path):
    texts, labels, _ = movie_reviews(movies=60)
    groups, _ = review_groups(texts, labels)
    assert grouped_split(labels, groups, 40, 3) == grouped_split(labels, groups, 40, 3)
    assert grouped_split(labels, groups, 40, 3) != grouped_split(labels, groups, 40, 4)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": texts, "label": labels}), tmp_path / "train.parquet")
    train, val = training_split(str(tmp_path), 40, 3)
    assert val.texts == [texts[i] for i in grouped_split(labels, groups, 40, 3)[1]]
    assert not set(train.texts) & set(val.texts)
