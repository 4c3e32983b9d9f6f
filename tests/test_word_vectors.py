"""Word vectors from co-occurrence counts (text.word_vectors) and --word-vectors, which starts the embedding there."""

import json

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from conftest import TINY_MODEL_ARGS
from rich.console import Console

from classify.errors import ClassifyError
from classify.models import Classifier, ClassifierConfig
from classify.text.word_vectors import cooccurrence, ppmi, word_vectors
from classify import train
from classify.train import main, start_from_word_vectors
from classify.train_config import TrainConfig


def test_cooccurrence_counts_each_pair_within_the_window_by_one_over_its_distance_inside_one_text():
    texts = [[1, 2, 3, 1], [4, 5]]
    counts = cooccurrence(texts, 6, window=2).toarray()
    expected = np.zeros((6, 6))
    for text in texts:   # the peer: every pair of positions, counted in both directions
        for i in range(len(text)):
            for j in range(len(text)):
                if 0 < abs(i - j) <= 2:
                    expected[text[i], text[j]] += 1 / abs(i - j)
    np.testing.assert_allclose(counts, expected, rtol=1e-6)
    assert counts[3, 4] == 0   # the end of one text is not beside the start of the next


def test_ppmi_is_the_positive_part_of_log_p_wc_over_p_w_p_c_with_smoothed_contexts():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 5, (7, 7)).astype(np.float64)
    counts = counts + counts.T
    p_wc = counts / counts.sum()
    p_w = counts.sum(1) / counts.sum()
    p_c = counts.sum(0) ** 0.75 / (counts.sum(0) ** 0.75).sum()
    with np.errstate(divide="ignore"):
        expected = np.maximum(np.log(p_wc / np.outer(p_w, p_c)), 0)
    np.testing.assert_allclose(ppmi(sp.csr_matrix(counts)).toarray(), expected, rtol=1e-5, atol=1e-6)


def test_words_used_alike_get_vectors_alike_and_a_word_never_seen_gets_none():
    # Words 1 and 2 each come between 3 and 4; words 5 and 6 between 7 and 8; word 9 never comes.
    rng = np.random.default_rng(0)
    texts = [[3, int(rng.choice([1, 2])), 4] if rng.random() < 0.5 else [7, int(rng.choice([5, 6])), 8]
             for _ in range(400)]
    vectors = word_vectors(texts, 10, 4)
    assert vectors.shape == (10, 4) and vectors.dtype == np.float32
    assert not vectors[9].any() and not vectors[0].any()
    assert np.isclose(vectors[1:9].std(), 0.02, rtol=1e-3)

    def cos(a, b):
        return vectors[a] @ vectors[b] / np.linalg.norm(vectors[a]) / np.linalg.norm(vectors[b])
    assert cos(1, 2) > 0.9 and cos(5, 6) > 0.9
    assert cos(1, 5) < 0.5 and cos(2, 6) < 0.5


def test_the_embedding_starts_from_the_vectors_where_the_texts_hold_the_word():
    torch.manual_seed(0)
    model = Classifier(vocab_size=12, d_model=8, num_heads=2, num_layers=1, d_ff=16, max_len=16)
    before = model.embed.tokens.weight.detach().clone()
    texts = [[3, 4, 5, 6], [4, 5, 7, 3], [6, 7, 8, 3], [0, 0]] * 20   # a padding id among them, as never happens
    start_from_word_vectors(model, texts, 0, Console(quiet=True))
    after = model.embed.tokens.weight.detach()
    vectors = torch.from_numpy(word_vectors(texts, 12, 8, 0))
    torch.testing.assert_close(after[3:9], vectors[3:9])
    torch.testing.assert_close(after[9:], before[9:])   # words the texts do not hold keep their random start
    torch.testing.assert_close(after[:3], before[:3])   # and so do the padding row and the special tokens


def test_word_vectors_by_default_start_the_run_there_are_recorded_and_refused_beside_init_from(parquet_data, tmp_path,
                                                                                               monkeypatch):
    started = []
    monkeypatch.setattr(train, "start_from_word_vectors", lambda model, ids, *rest: started.append(len(ids)))
    for flags, on in (([], True), (["--no-word-vectors"], False)):   # the recipe's default, and turned off
        out = tmp_path / f"run{len(flags)}"
        assert main(["--data", str(parquet_data), "--output", str(out), "--max-steps", "1", "--no-test", *flags,
                     *TINY_MODEL_ARGS]) == 0
        assert json.loads((out / "config.json").read_text())["train"]["word_vectors"] is on
    assert len(started) == 1 and started[0] > 0   # once, for the run that asked, on its training texts
    with pytest.raises(ClassifyError, match="--word-vectors starts the token embedding afresh"):
        TrainConfig(data="unused", word_vectors=True, init_from="a pretraining run").validate(ClassifierConfig(vocab_size=100))
