"""Shared fixtures: synthetic reviews in every supported format, a tiny trained run, real-data paths."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from pathlib import Path

import pytest

POSITIVE = ["great", "wonderful", "superb", "loved", "brilliant", "moving", "funny", "beautiful"]
NEGATIVE = ["awful", "boring", "terrible", "hated", "dull", "worst", "stupid", "waste"]
FILLER = ("the movie film plot actor story scene was and it a of this to in with director music "
          "cast ending character really quite very some time").split()
SHARED_IMDB = Path(__file__).resolve().parents[2] / "shared" / "imdb"
REPO = Path(__file__).resolve().parents[1]

# pytest-xdist's workers (addopts: -n auto) share the cores: each takes its share of torch's threads (torch's
# default already counts the cores this process may use), so that N workers do not run N x cores threads that wait
# on one another.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def subprocess_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child Python, the repository first on PYTHONPATH and the caller's entries
    kept (a machine may need them to find its packages), plus ``extra``."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            **extra}


def synthetic_reviews(n: int, seed: int = 0) -> list[tuple[str, int]]:
    """Reviews whose label is given by sentiment words mixed into neutral filler (learnable, not trivial:
    a few words of the other polarity appear too). Lengths vary from 8 to ~80 words; some have <br /> markup."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        label = i % 2
        words = [rng.choice(FILLER) for _ in range(rng.randint(8, 80))]
        main, other = (POSITIVE, NEGATIVE) if label else (NEGATIVE, POSITIVE)
        for _ in range(rng.randint(2, 4)):
            words.insert(rng.randrange(len(words)), rng.choice(main))
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), rng.choice(other))
        text = " ".join(words).capitalize() + "."
        if rng.random() < 0.2:
            text = text.replace(" the ", " the<br /><br />", 1)
        rows.append((text, label))
    return rows


def write_parquet_folder(folder: Path, train: int = 400, test: int = 200, then: Sequence[str] = ()) -> Path:
    """Synthetic reviews as train.parquet and test.parquet; each ends with the next of ``then`` (in turn) if given."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", train, 0), ("test", test, 1)):
        rows = [(f"{text} {then[i % len(then)]}" if then else text, label)
                for i, (text, label) in enumerate(synthetic_reviews(n, seed))]
        pq.write_table(pa.table({"text": [t for t, _ in rows], "label": [y for _, y in rows]}),
                       folder / f"{split}.parquet")
    return folder


def write_acl_imdb(folder: Path, n: int = 40) -> Path:
    for split, seed in (("train", 0), ("test", 1)):
        for i, (text, label) in enumerate(synthetic_reviews(n, seed)):
            d = folder / "aclImdb" / split / ("pos" if label else "neg")
            d.mkdir(parents=True, exist_ok=True)
            (d / f"{i}_{8 if label else 2}.txt").write_text(text, encoding="utf-8")
    unsup = folder / "aclImdb" / "train" / "unsup"
    unsup.mkdir(parents=True)
    for i, (text, _) in enumerate(synthetic_reviews(10, 2)):
        (unsup / f"{i}_0.txt").write_text(text, encoding="utf-8")
    return folder


def write_csv(path: Path, rows: list[tuple[str, int]]) -> Path:
    import csv

    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        writer.writerows(rows)
    return path


def write_jsonl(path: Path, rows: list[tuple[str, int]]) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for text, label in rows:
            f.write(json.dumps({"text": text, "label": label}) + "\n")
    return path


TINY_MODEL_ARGS = ["--d-model", "32", "--heads", "2", "--layers", "1", "--d-ff", "64", "--max-len", "64",
                   "--vocab-size", "200", "--batch-size", "16", "--warmup", "10", "--lr", "3e-3",
                   "--val-size", "80", "--quiet", "--precision", "fp32", "--ngram-buckets", "100003",
                   "--ngram-min-count", "2"]   # a few hundred reviews: at the recipe's 5 little has a weight


@pytest.fixture(scope="session")
def parquet_data(tmp_path_factory) -> Path:
    return write_parquet_folder(tmp_path_factory.mktemp("parquet"))


def flip(text: str) -> str:
    """The review with each sentiment word swapped for one of the other polarity (a counterfactual revision)."""
    swap = {**dict(zip(POSITIVE, NEGATIVE)), **dict(zip(NEGATIVE, POSITIVE))}
    return " ".join(swap.get(w.strip(".").lower(), w) + ("." if w.endswith(".") and w.strip(".").lower() in swap
                                                         else "") for w in text.split(" "))


@pytest.fixture(scope="session")
def counterfactual_data(tmp_path_factory) -> Path:
    """Counterfactual pairs in the layout of ../shared/imdb-counterfactual: the first 40 training reviews of
    ``parquet_data`` (the originals, as CAD's are IMDB training reviews) and their label-flipped revisions."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = synthetic_reviews(40, 0)
    texts, labels, pairs, kinds = [], [], [], []
    for pair, (text, label) in enumerate(rows):
        texts += [text, flip(text)]
        labels += [label, 1 - label]
        pairs += [pair, pair]
        kinds += ["original", "revised"]
    folder = tmp_path_factory.mktemp("counterfactual")
    pq.write_table(pa.table({"text": texts, "label": labels, "pair": pairs, "kind": kinds,
                             "imdb_split": ["train"] * len(texts)}), folder / "train.parquet")
    return folder


@pytest.fixture(scope="session")
def unlabelled_data(tmp_path_factory) -> Path:
    """The parquet folder plus an unsupervised.parquet (label -1)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = write_parquet_folder(tmp_path_factory.mktemp("imdb"))
    texts = [t for t, _ in synthetic_reviews(600, seed=7)]
    pq.write_table(pa.table({"text": texts, "label": [-1] * len(texts)}), folder / "unsupervised.parquet")
    return folder


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, parquet_data) -> Path:
    """A tiny classifier trained for a few epochs on synthetic reviews (shared by CLI tests; do not modify)."""
    from classify.train import main

    run = tmp_path_factory.mktemp("runs") / "tiny"
    # No rule-made texts (text.edits): cut from word salad they are noise to a model this small, and these runs
    # test what is done with a model, not how it learns.
    assert main(["--data", str(parquet_data), "--output", str(run), "--epochs", "4", "--no-negation-edits",
                 "--no-contrast-joins", *TINY_MODEL_ARGS]) == 0
    return run


@pytest.fixture(scope="session")
def int8_export(trained_run, tmp_path_factory) -> Path:
    """``trained_run`` exported with ``python -m classify.export --int8`` (shared by the export and load tests)."""
    pytest.importorskip("onnxruntime", reason="the export extra is not installed (pip install -e '.[export]')")
    from classify.export import main

    out = tmp_path_factory.mktemp("exports") / "int8"
    assert main(["--model", str(trained_run), "--output", str(out), "--int8"]) == 0
    return out


@pytest.fixture(scope="session")
def shared_imdb() -> Path:
    path = Path(os.environ.get("CLASSIFY_SHARED_IMDB", SHARED_IMDB))
    if not (path / "train.parquet").exists():
        pytest.skip(f"real IMDB parquet files not found at {path} (set CLASSIFY_SHARED_IMDB to run this test)")
    return path
