"""Swapped reviews: training reviews with their polar words exchanged for words of the other polarity, under the
other label: counterfactual texts made by machine, many more than the ~1,100 pairs people wrote.

A model that recognises a review it was trained on answers an edited copy of it with the original's label: the
plot, the names and the unchanged sentences pull it there (on the held-out counterfactual pairs the transformer
alone reads 3-4 points fewer revisions of training reviews than of validation reviews, experiments/RESULTS.md).
Here each training review also comes with a copy in which every polar word is replaced by its nearest word of the
other polarity, under the other label: what the two share cannot decide the label, only the exchanged words can
(the automatically generated counterfactuals of Wang and Culotta 2021, "Robustness to Spurious Correlations in Text
Classification via Automatically Generated Counterfactuals", with antonyms from word vectors instead of a lexicon).

Everything is counted from the training reviews in token ids, with no word list:

- ``log_count_ratios``: each token's polarity, the log of how much more often positive reviews hold it than negative
  ones (Wang and Manning's NBSVM ratios, ``text.edits.nbsvm_ratios``);
- ``antonyms``: for each polar word, the polar word of the other sign nearest to it in word vectors
  (``text.word_vectors``: words used alike lie near, antonyms among them: "excellent" -> "poor", "boring" ->
  "absorbing"), kept where they are near enough;
- ``swapped_reviews``: the copies, kept only where the ratios read the copy as the other label by a margin (a
  review whose sentiment sits in words without a partner is left out rather than mislabelled).

On IMDB's 25,000 training reviews (a recipe run's tokenizer and word vectors): 2,900 words get a partner ("great"
-> "decent", "beautiful" -> "ugly", "poor" -> "excellent", "avoid" -> "recommended", and many a loose one:
"minutes" -> "seasons"), about 4% of a review's tokens are exchanged, 8,360 reviews give a copy, and the run's
transformer alone reads 93% of the first 2,000 copies as their new label, the n-gram branch, which recognises the
reviews, 60%. Trained on, they did not move the held-out revisions (-0.1 point over two pairs, IMDB test -0.08):
not in the recipe (experiments/RESULTS.md, fifty-seventh session).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .edits import nbsvm_ratios

MIN_RATIO = 0.5        # a word is polar when one class's reviews hold it e^0.5 = 1.65x as often as the other's
MIN_DOCS = 30          # ... and at least this many training reviews hold it (rarer ratios are noise)
MIN_SIMILARITY = 0.35  # the least cosine between a word and the partner it is exchanged for
MARGIN = 1.0           # a copy is kept when its summed ratios lean to the new label by at least this much


def log_count_ratios(ids: Sequence[np.ndarray], labels: Sequence[int], vocab_size: int,
                     alpha: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Token id lists and their labels (0/1) -> (each token's log-count ratio (V,), positive for tokens that positive
    reviews hold more often: ``text.edits.nbsvm_ratios`` over token ids; how many reviews hold it (V,))."""
    holding = np.zeros((2, vocab_size))
    for text, label in zip(ids, labels):
        holding[label, np.unique(np.asarray(text, dtype=np.int64))] += 1
    reviews = np.bincount(np.asarray(labels, dtype=np.int64), minlength=2)
    return nbsvm_ratios(holding, reviews, alpha), holding.sum(axis=0)


def antonyms(vectors: np.ndarray, ratio: np.ndarray, docs: np.ndarray, words: np.ndarray,
             min_ratio: float = MIN_RATIO, min_docs: int = MIN_DOCS,
             min_similarity: float = MIN_SIMILARITY) -> np.ndarray:
    """Each token's partner of the other polarity, (V,) token ids, -1 for none. ``vectors`` (V, D): word vectors;
    ``ratio``, ``docs`` (V,): ``log_count_ratios``; ``words`` (V,) bool: the tokens that are words (not
    punctuation, numbers or special tokens). A polar word (``min_ratio``, ``min_docs``) gets the polar word of the
    other sign with the highest cosine to it, if that is at least ``min_similarity``."""
    unit = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    polar = words & (np.abs(ratio) >= min_ratio) & (docs >= min_docs)
    partner = np.full(len(ratio), -1, dtype=np.int64)
    positive, negative = np.flatnonzero(polar & (ratio > 0)), np.flatnonzero(polar & (ratio < 0))
    if len(positive) and len(negative):
        for source, target in ((positive, negative), (negative, positive)):
            similarity = unit[source] @ unit[target].T                            # (S, T)
            best = similarity.argmax(axis=1)
            near = similarity[np.arange(len(source)), best] >= min_similarity
            partner[source[near]] = target[best[near]]
    return partner


def swapped_reviews(ids: Sequence[np.ndarray], labels: Sequence[int], partner: np.ndarray, ratio: np.ndarray,
                    margin: float = MARGIN) -> tuple[list[np.ndarray], list[int]]:
    """The reviews (token id lists, labels 0/1) with every word that has a partner exchanged for it, under the
    other label; only copies whose distinct tokens' summed ``ratio`` leans to the new label by ``margin`` or more
    (and whose review leaned to its own label) are returned, in the reviews' order."""
    out_ids, out_labels = [], []
    for text, label in zip(ids, labels):
        text = np.asarray(text, dtype=np.int64)
        swapped = np.where(partner[text] >= 0, partner[text], text)
        sign = 2 * label - 1
        if sign * ratio[np.unique(text)].sum() > 0 and -sign * ratio[np.unique(swapped)].sum() >= margin:
            out_ids.append(swapped.astype(np.int32))   # as ``Preprocessing.ids`` gives them
            out_labels.append(1 - label)
    return out_ids, out_labels
