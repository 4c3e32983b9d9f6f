"""Validation that does not flatter: group reviews by movie, and never split a group.

IMDB's train and test reviews come from disjoint movies, and a model learns movie-specific words
(titles, characters, actors, plot nouns) that only pay off for other reviews of the same movie. A
validation split drawn at random from train shares movies with the training part, so it rewards
that memorisation and overstates test accuracy (by 3.5 points for the transformer recipe of
November 2026). The data carries no movie ids, so groups are recovered from the data itself:

* ``ordered``: the original aclImdb files are numbered movie by movie (reviews of one movie have
  consecutive ids, at most 30 per movie), and both the parquet folder in ``../shared`` and the
  aclImdb loader keep that order. When neighbouring rows share rare words far more often than
  random pairs of rows do (``ORDER_EVIDENCE`` times as often at least; a shuffled file shows no excess),
  the order carries the movies, and groups are runs of about ``ORDERED_BLOCK`` consecutive rows of
  one label, cut between rows that share no rare word.
* ``similar``: otherwise (a shuffled source, such as the Hugging Face hub's tar order, or a
  ``--limit`` sample), reviews are linked when their rare words overlap (cosine similarity of
  idf-weighted rare-word sets), strongest links first, with groups capped at 30 reviews.

How well each removes the leak is measured by a memorisation probe, a logistic regression on rare
words alone (``experiments/validation_split.py``; results in experiments/RESULTS.md).
"""

from __future__ import annotations

import numpy as np

from ..errors import ClassifyError

ORDERED_BLOCK = 25           # rows per group (at least) when the row order follows the movies
MAX_GROUP = 30               # IMDB keeps at most 30 reviews of one movie
RARE_MAX_DF = 50             # a word in at most this many reviews is "rare" (movie-specific), ...
RARE_MAX_SHARE = 1 / 100     # ... and in at most this share of them (in small data, 50 reviews is many)
LINK_SIMILARITY = 0.05       # cosine similarity of rare-word sets that links two reviews
ORDER_EVIDENCE = 5.0         # neighbours must share rare words this many times more often than random pairs


def _rare_word_matrix(texts: list[str]):
    """Binary (reviews x rare words) CSR matrix; rare = in 2..RARE_MAX_DF reviews (RARE_MAX_SHARE at most)."""
    from sklearn.feature_extraction.text import CountVectorizer

    max_df = max(2, min(RARE_MAX_DF, int(len(texts) * RARE_MAX_SHARE)))
    vectorizer = CountVectorizer(binary=True, min_df=2, max_df=max_df, dtype=np.float32,
                                 token_pattern=r"(?u)\b[^\W\d_]{2,}\b")
    try:
        return vectorizer.fit_transform(texts)
    except ValueError:  # no word occurs in two reviews (tiny or odd data): no evidence of any group
        return None


def _neighbours_share(words) -> np.ndarray:
    """(N-1,) bool: row i and row i+1 share a rare word."""
    return np.asarray(words[:-1].multiply(words[1:]).sum(axis=1)).ravel() > 0


def _follows_movies(words) -> bool:
    """Whether consecutive rows share rare words far more often than random pairs of rows."""
    n = words.shape[0]
    if n < 3:
        return False
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, n, size=(2, 5 * n))
    keep = a != b
    random_pairs = np.asarray(words[a[keep]].multiply(words[b[keep]]).sum(axis=1)).ravel() > 0
    return _neighbours_share(words).mean() > ORDER_EVIDENCE * max(random_pairs.mean(), 1.0 / len(random_pairs))


def _ordered_groups(words, labels: list[int]) -> np.ndarray:
    """Runs of consecutive rows of one label, at least ORDERED_BLOCK long: a run ends at the first
    row after that which shares no rare word with the next (so a visible movie is not cut), or at
    twice that length."""
    y = np.asarray(labels)
    share = _neighbours_share(words)
    groups = np.zeros(len(y), dtype=np.int64)
    group, size = 0, 0
    for i in range(len(y)):
        if i and (y[i] != y[i - 1] or size >= 2 * ORDERED_BLOCK or (size >= ORDERED_BLOCK and not share[i - 1])):
            group, size = group + 1, 0
        groups[i] = group
        size += 1
    return groups


def _similarity_groups(words) -> np.ndarray:
    """Link reviews by rare-word cosine similarity, strongest first, groups capped at MAX_GROUP."""
    import scipy.sparse as sp

    n = words.shape[0]
    df = np.asarray(words.sum(axis=0)).ravel()
    weighted = words.multiply(np.log(n / df)).tocsr()
    norms = np.sqrt(np.asarray(weighted.multiply(weighted).sum(axis=1)).ravel())
    unit = sp.diags(1.0 / np.maximum(norms, 1e-12)) @ weighted
    sim = (unit @ unit.T).tocoo()
    keep = (sim.row < sim.col) & (sim.data >= LINK_SIMILARITY)
    rows, cols, values = sim.row[keep], sim.col[keep], sim.data[keep]
    parent, size = np.arange(n), np.ones(n, dtype=np.int64)

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for k in np.argsort(-values, kind="stable"):
        a, b = find(rows[k]), find(cols[k])
        if a != b and size[a] + size[b] <= MAX_GROUP:
            parent[a], size[b] = b, size[a] + size[b]
    return np.array([find(i) for i in range(n)])


def review_groups(texts: list[str], labels: list[int]) -> tuple[np.ndarray, str]:
    """A group id per review (reviews of one movie share one, as far as the data shows) and the
    method that found them: ``"ordered"`` or ``"similar"`` (see the module docstring)."""
    words = _rare_word_matrix(texts)
    if words is None:
        return np.arange(len(texts)), "similar"
    if _follows_movies(words):
        return _ordered_groups(words, labels), "ordered"
    return _similarity_groups(words), "similar"


def grouped_split(labels: list[int], groups: np.ndarray, val_size: int, seed: int) -> tuple[list[int], list[int]]:
    """Seeded split of row indices into (train, validation): whole groups go to validation, in a
    seeded random order, while each class stays within its share of ``val_size``."""
    n = len(labels)
    if val_size <= 0:
        return list(range(n)), []
    if val_size >= n:
        raise ClassifyError(f"validation size {val_size} leaves no training data (only {n} examples)")
    y = np.asarray(labels)
    classes, counts = np.unique(y, return_counts=True)
    quota = dict(zip(classes.tolist(), np.round(counts / n * val_size).astype(int).tolist()))
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups.tolist()):
        members.setdefault(g, []).append(i)
    taken = dict.fromkeys(quota, 0)
    val: list[int] = []
    for g in np.random.default_rng(seed).permutation(sorted(members)).tolist():
        rows = members[g]
        need = {c: int((y[rows] == c).sum()) for c in quota}
        if all(taken[c] + need[c] <= quota[c] for c in quota):
            val += rows
            for c in quota:
                taken[c] += need[c]
        if taken == quota:
            break
    chosen = set(val)
    return [i for i in range(n) if i not in chosen], sorted(val)
