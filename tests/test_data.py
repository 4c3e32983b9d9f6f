"""Loaders for every source, label checks, normalisation, splits, tokenizer round-trip."""

import json
import sys

import pytest
from conftest import synthetic_reviews, write_acl_imdb, write_csv, write_jsonl

from classify.errors import ClassifyError
from classify.text.data import load_split, normalize, stratified_split
from classify.text.tokenize import PAD, encode, load_tokenizer, train_tokenizer, truncate


def test_parquet_folder(parquet_data):
    train = load_split(parquet_data, "train")
    test = load_split(parquet_data, "test")
    assert (len(train), len(test)) == (400, 200)
    assert set(train.labels) == {0, 1}
    with pytest.raises(ClassifyError, match="unsupervised.parquet"):
        load_split(parquet_data, "unsupervised")


@pytest.mark.parametrize("nested", [True, False])
def test_acl_imdb_folder(tmp_path, nested):
    root = write_acl_imdb(tmp_path)
    source = root if nested else root / "aclImdb"
    train = load_split(source, "train")
    assert len(train) == 40 and sorted(set(train.labels)) == [0, 1]
    unsup = load_split(source, "unsupervised", labelled=False)
    assert len(unsup) == 10 and set(unsup.labels) == {-1}
    expected = dict((t, y) for t, y in synthetic_reviews(40, 0))
    assert all(expected[t] == y for t, y in zip(train.texts, train.labels))


@pytest.mark.parametrize("writer,suffix", [(write_csv, ".csv"), (write_jsonl, ".jsonl")])
def test_csv_and_jsonl_files(tmp_path, writer, suffix):
    rows = synthetic_reviews(30)
    path = writer(tmp_path / f"reviews{suffix}", rows)
    examples = load_split(path, "train")
    assert examples.texts == [t for t, _ in rows]
    assert examples.labels == [y for _, y in rows]


def test_local_files_are_read_without_datasets(tmp_path, parquet_data, monkeypatch):
    """Local files never go through ``datasets`` (which would copy each into its cache): with it unimportable
    every format still loads; a CSV field may hold line breaks and a text that looks like a number stays text;
    a .json file may be one array; an unreadable file is one clear error."""
    monkeypatch.setitem(sys.modules, "datasets", None)
    assert len(load_split(parquet_data, "train")) == 400
    (tmp_path / "quoted.csv").write_text('text,label\n"Two lines,\nstill one review",1\n10,0\n', encoding="utf-8")
    assert load_split(tmp_path / "quoted.csv").texts == ["Two lines,\nstill one review", "10"]
    rows = synthetic_reviews(5)
    (tmp_path / "array.json").write_text(json.dumps([{"text": t, "label": y} for t, y in rows]), encoding="utf-8")
    assert load_split(tmp_path / "array.json").labels == [y for _, y in rows]
    lines = [{"text": "one\u2028paragraph", "label": 1}, {"text": "two", "label": 0}]   # a raw line separator
    (tmp_path / "raw.jsonl").write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in lines), encoding="utf-8")
    assert load_split(tmp_path / "raw.jsonl").texts == ["one\u2028paragraph", "two"]
    (tmp_path / "blank.jsonl").write_text("\n", encoding="utf-8")
    with pytest.raises(ClassifyError, match="empty"):
        load_split(tmp_path / "blank.jsonl")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ClassifyError, match="cannot read"):
        load_split(tmp_path / "broken.parquet")
    (tmp_path / "broken.jsonl").write_text('{"text": "fine", "label": 1}\n{"text": \n', encoding="utf-8")
    with pytest.raises(ClassifyError, match="cannot read"):
        load_split(tmp_path / "broken.jsonl")


def test_string_labels_neg_pos_accepted(tmp_path):
    path = write_csv(tmp_path / "named.csv", [("good film", "pos"), ("bad film", "neg")])
    assert load_split(path).labels == [1, 0]


@pytest.mark.parametrize("rows,message", [
    ([("fine", 2)], "label 2"),
    ([("fine", -1)], "label -1"),
    ([("fine", "maybe")], "label 'maybe'"),
    ([("fine", 0.5)], "label 0.5"),
])
def test_bad_labels_rejected(tmp_path, rows, message):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ClassifyError, match=message):
        load_split(path)


def test_missing_text_column_and_empty_and_missing_files(tmp_path):
    (tmp_path / "cols.csv").write_text("review,label\nhello,1\n")
    with pytest.raises(ClassifyError, match="no 'text' column"):
        load_split(tmp_path / "cols.csv")
    (tmp_path / "empty.csv").write_text("text,label\n")
    with pytest.raises(ClassifyError, match="empty"):
        load_split(tmp_path / "empty.csv")
    with pytest.raises(ClassifyError, match="not found"):
        load_split(tmp_path / "nope.csv")
    (tmp_path / "data.txt").write_text("x")
    with pytest.raises(ClassifyError, match="unsupported"):
        load_split(tmp_path / "data.txt")
    with pytest.raises(ClassifyError, match="neither"):
        load_split(tmp_path)


def test_normalize():
    assert normalize("Great<br /><br />film &amp; cast  ") == "Great film & cast"
    assert normalize("<br/>") == ""
    assert normalize("a<BR>b") == "a b"


def test_stratified_split_is_seeded_and_stratified():
    labels = [0] * 60 + [1] * 40
    a = stratified_split(labels, 20, seed=1)
    assert a == stratified_split(labels, 20, seed=1)
    assert a != stratified_split(labels, 20, seed=2)
    train, val = a
    assert len(val) == 20 and not set(train) & set(val) and len(train) + len(val) == 100
    assert sum(labels[i] for i in val) == 8  # 40% positives kept
    with pytest.raises(ClassifyError):
        stratified_split(labels, 100, seed=0)


@pytest.mark.parametrize("kind", ["word", "bpe", "wordpiece"])
def test_tokenizer_round_trip(tmp_path, kind):
    texts = [normalize(t) for t, _ in synthetic_reviews(200)]
    tok = train_tokenizer(texts, vocab_size=300, kind=kind)
    assert tok.token_to_id(PAD) == 0
    tok.save(str(tmp_path / "tokenizer.json"))
    again = load_tokenizer(tmp_path / "tokenizer.json")
    assert encode(tok, texts[:5], 64) == encode(again, texts[:5], 64)
    assert tok.encode("Great FILM").ids == tok.encode("great film").ids  # lower-cased


def test_corrupt_tokenizer_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ClassifyError, match="corrupt"):
        load_tokenizer(tmp_path / "tokenizer.json")


def test_truncation_strategies():
    ids = list(range(10))
    assert truncate(ids, 4, "head") == [0, 1, 2, 3]
    assert truncate(ids, 4, "tail") == [6, 7, 8, 9]
    assert truncate(ids, 4, "head+tail") == [0, 7, 8, 9]
    assert truncate(ids, 20, "head") == ids
