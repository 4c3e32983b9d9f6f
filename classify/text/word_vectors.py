"""Word vectors from co-occurrence counts, to start the transformer's token embedding from.

Most of the classifier's weights are its token embedding (30,000 x 128 of 4.3M), and a recipe that trains for about
one pass over the reviews updates a word's row only in the batches that hold the word: the rarer words of the
vocabulary end training nearer their random start than the common ones (in a recipe run, rows of the rarest
thousands of words end at a third of the norm of the commonest). Vectors counted from the reviews themselves
(positive pointwise mutual information of words within a few tokens of each other, reduced by a truncated SVD;
Levy, Goldberg and Dagan 2015, "Improving Distributional Similarity with Lessons Learned from Word Embeddings")
give every word a start near the words used like it, in 22-26 seconds on IMDB's 72,500 training and unlabelled
reviews. No labels are read.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import scipy.sparse as sp

WINDOW = 5             # words up to this many tokens apart co-occur, each pair counted 1 / distance
CONTEXT_SMOOTHING = 0.75   # contexts' counts raised to this power: rare contexts weigh less in the PMI (Levy et al.)
SCALE = 0.02           # the vectors' entries get this standard deviation: the usual initial scale of an embedding


def cooccurrence(ids: Sequence[Sequence[int]], vocab_size: int, window: int = WINDOW) -> sp.csr_matrix:
    """Token id lists -> (V, V) symmetric counts of words within ``window`` tokens of each other in one text,
    each pair weighted 1 / distance."""
    ids = [np.asarray(t, dtype=np.int64) for t in ids if len(t)]
    counts = sp.csr_matrix((vocab_size, vocab_size), dtype=np.float32)
    if not ids:
        return counts
    flat = np.concatenate(ids)
    text = np.repeat(np.arange(len(ids)), [len(t) for t in ids])
    for distance in range(1, window + 1):
        same_text = text[:-distance] == text[distance:]
        left, right = flat[:-distance][same_text], flat[distance:][same_text]
        pairs = sp.coo_matrix((np.full(len(left), 1.0 / distance, dtype=np.float32), (left, right)),
                              shape=(vocab_size, vocab_size)).tocsr()   # duplicates summed
        counts = counts + pairs + pairs.T
    return counts


def ppmi(counts: sp.csr_matrix, smoothing: float = CONTEXT_SMOOTHING) -> sp.csr_matrix:
    """(V, V) co-occurrence counts -> their positive pointwise mutual information (V, V), sparse: log P(w, c) /
    (P(w) P_s(c)) where positive, with the contexts' distribution smoothed (counts ** ``smoothing``)."""
    counts = counts.tocoo()
    keep = counts.data > 0
    rows, cols, data = counts.row[keep], counts.col[keep], counts.data[keep].astype(np.float64)
    words = np.bincount(rows, weights=data, minlength=counts.shape[0])
    contexts = np.bincount(cols, weights=data, minlength=counts.shape[1]) ** smoothing
    pmi = np.log(data * contexts.sum() / (words[rows] * contexts[cols]))
    positive = pmi > 0
    return sp.csr_matrix((pmi[positive].astype(np.float32), (rows[positive], cols[positive])), shape=counts.shape)


def word_vectors(ids: Sequence[Sequence[int]], vocab_size: int, dim: int, seed: int = 0,
                 window: int = WINDOW, scale: float = SCALE) -> np.ndarray:
    """Token id lists -> word vectors (V, ``dim``), float32: the PPMI matrix's top ``dim`` singular directions,
    each weighted by the square root of its singular value, the whole scaled to entries of standard deviation
    ``scale``. A word that co-occurs with nothing (never in ``ids``) gets a row of zeros; so do the columns beyond
    the matrix's rank when ``dim`` >= V."""
    matrix = ppmi(cooccurrence(ids, vocab_size, window))
    vectors = np.zeros((vocab_size, dim), dtype=np.float32)
    rank = min(dim, vocab_size - 1)
    if matrix.nnz == 0 or rank < 1:
        return vectors
    # Imported here, as the package imports scikit-learn everywhere: at the top it adds ~2.5 s to every start of
    # classify.train (its --help, its one-line errors), which needs it only at this step.
    from sklearn.utils.extmath import randomized_svd

    u, s, _ = randomized_svd(matrix, rank, n_iter=3, random_state=seed)
    seen = np.diff(matrix.indptr) > 0          # the SVD leaves rounding noise, not zeros, on the others
    vectors[seen, :rank] = (u * np.sqrt(s))[seen]
    vectors *= scale / vectors[seen].std()
    return vectors
