"""Typing slips read as the words meant: ``text.spelling.Speller`` and ``Preprocessing(spelling=True)``."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from classify.inference import classify_texts, load_run
from classify.text.prepare import Preprocessing
from classify.text.spelling import Speller
from classify.text.tokenize import UNK, train_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    # "boring" is more frequent than "boing" (one edit from "borng" both), "cat" / "car" make a short word's
    # neighbours; every word appears at least twice, so all are in the vocabulary.
    texts = ["the film was boring and the plot was wonderful"] * 6 + ["a boing sound", "a boing noise"] + \
            ["the cat and the car", "a weak cat and a weak car"]
    return train_tokenizer(texts, vocab_size=100)


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def test_a_slip_is_read_as_the_word_meant(tokenizer):
    speller = Speller(tokenizer)
    for slip in ("wondreful", "wonderfull", "wonderfl", "wonderfyl"):   # swap, insert, delete, replace
        text = f"the plot was {slip}"
        encoding = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.token_to_id(UNK) in encoding.ids
        ids, fixes = speller.correct(text, encoding.ids, encoding.offsets)
        assert ids == ids_of(tokenizer, "the plot was wonderful")
        assert fixes == [(slip, "wonderful")]


def test_the_more_frequent_neighbour_wins_and_other_words_stay(tokenizer):
    speller = Speller(tokenizer)
    assert speller.nearest("borng") == ("boring", tokenizer.token_to_id("boring"))   # not "boing"
    assert speller.nearest("zzzzzz") is None              # no known word one edit away: stays unknown
    assert speller.nearest("wodnerfull") is None          # two edits away
    assert speller.nearest("ca") is None                  # too short to choose among "cat", "car", ...
    assert speller.nearest("tweak") is None               # a word of English, not a slip of "weak"
    assert speller.nearest("weeak") == ("weak", tokenizer.token_to_id("weak"))
    text = "The film was WONDREFUL xqzt"
    encoding = tokenizer.encode(text, add_special_tokens=False)
    ids, fixes = speller.correct(text, encoding.ids, encoding.offsets)
    assert fixes == [("WONDREFUL", "wonderful")]          # case as written in the note, read lower-cased
    assert ids[:-1] == ids_of(tokenizer, "the film was wonderful") and ids[-1] == tokenizer.token_to_id(UNK)


def test_a_capitalised_word_inside_a_sentence_is_taken_for_a_name(tokenizer):
    speller = Speller(tokenizer)
    for text, fixed in [("the film was Borng", []), ("the film. Borng plot", [("Borng", "boring")]),
                        ("Borng film", [("Borng", "boring")]), ("the film was BORNG", [("BORNG", "boring")])]:
        encoding = tokenizer.encode(text, add_special_tokens=False)
        assert speller.correct(text, encoding.ids, encoding.offsets)[1] == fixed, text


def test_only_word_level_tokenizers_get_a_speller(tokenizer):
    texts = ["the film was boring and the plot was wonderful"] * 5
    assert Speller.for_tokenizer(tokenizer) is not None
    assert Speller.for_tokenizer(train_tokenizer(texts, vocab_size=60, kind="bpe")) is None


def test_preprocessing_reads_slips_only_when_asked(tokenizer):
    plain = Preprocessing(tokenizer, max_len=16, truncation="head+tail")
    spelled = dataclasses.replace(plain, spelling=True)
    [raw] = plain(["The plot was wondreful."])
    [read] = spelled(["The plot was wondreful."])
    assert tokenizer.token_to_id(UNK) in raw.ids and raw.notes == []
    assert read.ids == ids_of(tokenizer, "the plot was wonderful.")
    assert read.notes == ["read 'wondreful' as 'wonderful'"]
    many = " ".join(["wondreful"] * 7)
    [long] = spelled([many])
    assert long.notes == ["read " + ", ".join(["'wondreful' as 'wonderful'"] * 5) + " and 2 more"]
    assert list(spelled.ids(["The plot was wondreful."])[0]) == read.ids


def test_a_run_reads_slips_as_its_config_says(trained_run, tmp_path):
    config = json.loads((trained_run / "config.json").read_text())
    assert config["train"]["spelling"] is True                  # the default, recorded in the run
    run_dir = shutil.copytree(trained_run, tmp_path / "run", ignore=shutil.ignore_patterns("last"))
    for train in ({k: v for k, v in config["train"].items() if k != "spelling"},   # a run from before the setting
                  {**config["train"], "spelling": False}):
        (run_dir / "config.json").write_text(json.dumps({**config, "train": train}))
        run = load_run(run_dir, torch.device("cpu"))
        assert run.preprocessing.spelling is False
        assert classify_texts(run, ["a wondreful film"])[0].notes == []
    (run_dir / "config.json").write_text(json.dumps(config))
    run = load_run(run_dir, torch.device("cpu"))
    # One call each: two rows of one batch may round differently in the last bits (blocked matrix products).
    slip, meant = (classify_texts(run, [text])[0]
                   for text in ("a wondreful and moving film", "a wonderful and moving film"))
    assert slip.notes == ["read 'wondreful' as 'wonderful'"] and meant.notes == []
    assert slip.probabilities.tolist() == meant.probabilities.tolist()
