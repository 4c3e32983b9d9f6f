"""--word-polarity: one direction of the token embedding starts at each word's weight in stage 1's first n-gram
fit (``NgramBag.word_values``, ``train.start_from_word_polarity``)."""

import json

import numpy as np
import pytest
import torch
from conftest import NEGATIVE, POSITIVE, TINY_MODEL_ARGS
from rich.console import Console

from classify import train
from classify.errors import ClassifyError
from classify.models import Classifier, ClassifierConfig
from classify.ngrams import NgramBag
from classify.text.tokenize import load_tokenizer
from classify.train import POLARITY_SCALE, main, start_from_word_polarity
from classify.train_config import TrainConfig

TOWARDS_POSITIVE = torch.tensor([-1.0, 1.0])


def test_a_words_value_is_what_a_plain_bag_gives_it_alone_and_the_other_families_leave_it():
    torch.manual_seed(0)
    plain = NgramBag(20, 2, 3, 97, pad_id=0)
    every = NgramBag(20, 2, 3, 97, pad_id=0, skip_bigrams=True, head=3, tail=3, negation=2, negators=(5,),
                     breaks=(6,))
    with torch.no_grad():
        plain.weight.normal_()
        plain.weight[-1] = 0   # the padding slot
        plain.bias.normal_()
        every.weight.copy_(plain.weight)
    alone = torch.arange(20)[:, None]                                            # (V, 1): one-word texts
    peer = (plain(alone) - plain.bias) @ TOWARDS_POSITIVE                        # the bag's own logits
    values = plain.word_values(TOWARDS_POSITIVE)
    torch.testing.assert_close(values[1:], peer[1:])
    assert values[0] == 0   # the padding id
    # A word's own slot is the same whatever else the branch reads (its head/tail n-grams are other slots, which
    # a one-word text also fills, so the two bags' logits differ while the words' values do not).
    torch.testing.assert_close(every.word_values(TOWARDS_POSITIVE), values)
    assert not torch.allclose((every(alone) - every.bias) @ TOWARDS_POSITIVE, peer)


def test_one_direction_of_the_embedding_holds_the_polarity_and_the_rest_of_each_row_stays():
    torch.manual_seed(0)
    model = Classifier(vocab_size=12, d_model=8, num_heads=2, num_layers=1, d_ff=16, max_len=16)
    before = model.embed.tokens.weight.detach().clone()
    head = model.head.weight.detach().clone()
    polarity = np.array([0, 0, 0.5, -2.0, 1.0, 0, 3.0, -0.5, 0.2, 0, -1.0, 0.7], dtype=np.float32)
    start_from_word_polarity(model, polarity, 0, Console(quiet=True))
    after = model.embed.tokens.weight.detach()
    torch.testing.assert_close(after[0], before[0])   # the padding row
    change = after - before
    u = torch.linalg.svd(change).Vh[0]                 # the one direction every row moved along
    torch.testing.assert_close(change - (change @ u)[:, None] * u, torch.zeros_like(change), atol=1e-6, rtol=0)
    p = torch.from_numpy(polarity)
    along = after @ u
    along = along * torch.sign(along @ p)              # u's sign is the SVD's choice
    weighted = p != 0
    # Along u each row but the padding row holds its word's weight, scaled to POLARITY_SCALE (a word without one: 0)
    expected = p / p[weighted].square().mean().sqrt() * POLARITY_SCALE
    torch.testing.assert_close(along[1:], expected[1:], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(model.head.weight.detach(), head)   # the head is left alone


def test_the_run_starts_from_the_first_fits_word_weights_records_it_and_refuses_without_a_fit(parquet_data, tmp_path,
                                                                                            monkeypatch):
    seen = []
    monkeypatch.setattr(train, "start_from_word_polarity", lambda model, polarity, *rest: seen.append(polarity))
    out = tmp_path / "run"
    assert main(["--data", str(parquet_data), "--output", str(out), "--max-steps", "1", "--no-test",
                 "--word-polarity", *TINY_MODEL_ARGS]) == 0
    assert json.loads((out / "config.json").read_text())["train"]["word_polarity"] is True
    (polarity,) = seen
    tokenizer = load_tokenizer(out / "tokenizer.json")
    assert polarity.shape == (tokenizer.get_vocab_size(),)

    def weight(word: str) -> float:
        return float(polarity[tokenizer.token_to_id(word)])
    assert all(weight(w) > 0 for w in POSITIVE) and all(weight(w) < 0 for w in NEGATIVE)
    with pytest.raises(ClassifyError, match="--word-polarity reads each word's weight"):
        TrainConfig(data="unused", word_polarity=True, pseudo_labels=False).validate(ClassifierConfig(vocab_size=100))
