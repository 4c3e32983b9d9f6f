"""Loading labelled text from every supported source, normalising it, and splitting it.

Sources (``--data``):

* a Hugging Face hub id, e.g. ``stanfordnlp/imdb`` (needs a network), via ``datasets``;
* a folder of parquet files with the hub's schema: ``train.parquet``, ``test.parquet``,
  optionally ``unsupervised.parquet`` (columns ``text``, ``label``);
* the original ``aclImdb/`` folder (``train/pos/*.txt``, ``train/neg/*.txt``, ``test/...``,
  ``train/unsup/*.txt``), or a folder that contains it;
* one CSV, JSONL/JSON or parquet file with ``text`` and ``label`` columns (it is the
  "train" split; evaluation of a file uses the whole file).

The default source is ``$CLASSIFY_DATA`` if set, else the hub dataset.
"""

from __future__ import annotations

import html
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ClassifyError

HUB_DEFAULT = "stanfordnlp/imdb"
LABEL_NAMES = ("neg", "pos")
FILE_FORMATS = {".csv": "csv", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
SPLITS = ("train", "test", "unsupervised")


def default_source() -> str:
    return os.environ.get("CLASSIFY_DATA", HUB_DEFAULT)


# ------------------------------------------------------------------- normalisation
_BREAK = re.compile(r"<\s*br\s*/?\s*>", re.IGNORECASE)
_TAG = re.compile(r"<[^>]{0,40}>")
_SPACE = re.compile(r"\s+")


def normalize(text: str) -> str:
    """The same clean-up at train and predict time: HTML line breaks and tags to spaces,
    entities unescaped, runs of whitespace collapsed. Case is left to the tokenizer."""
    text = _BREAK.sub(" ", text)
    text = _TAG.sub(" ", text)
    text = html.unescape(text)
    return _SPACE.sub(" ", text).strip()


# -------------------------------------------------------------------------- loading
@dataclass
class Examples:
    """Parallel lists of texts and integer labels (-1 = unlabelled)."""

    texts: list[str]
    labels: list[int]

    def __len__(self) -> int:
        return len(self.texts)

    def subset(self, indices) -> "Examples":
        return Examples([self.texts[i] for i in indices], [self.labels[i] for i in indices])


def load_split(source: str, split: str = "train", num_classes: int = 2, labelled: bool = True) -> Examples:
    """Load one split of ``source`` and check it: non-empty, text present, labels in range.

    ``labelled=False`` accepts label -1 (unlabelled text, e.g. the unsupervised split).
    """
    source = str(source)
    path = Path(source).expanduser()
    if path.is_dir():
        examples = _load_folder(path, split)
    elif path.is_file():
        examples = _load_file(path)
    elif source.startswith((".", "/", "~")) or Path(source).suffix in FILE_FORMATS:
        raise ClassifyError(f"data not found: {source}")
    else:
        examples = _load_hub(source, split)
    return _check(examples, f"{source} [{split}]", num_classes, labelled)


def provides_split(source: str, split: str) -> bool:
    """Whether ``source`` has a distinct ``split`` (a single file is only ever the training data)."""
    path = Path(str(source)).expanduser()
    if path.is_file():
        return split == "train"
    if path.is_dir():
        folder = "train/unsup" if split == "unsupervised" else split  # aclImdb keeps unlabelled text there
        acl = [root for root in (path, path / "aclImdb") if (root / folder).is_dir()]
        return (path / f"{split}.parquet").exists() or bool(acl)
    return True  # hub datasets: let the loader answer


def _load_folder(path: Path, split: str) -> Examples:
    parquet = path / f"{split}.parquet"
    if parquet.exists():
        return _load_file(parquet)
    for root in (path, path / "aclImdb"):
        if (root / "train").is_dir() and ((root / "train" / "pos").is_dir() or (root / "test" / "pos").is_dir()):
            return _load_acl_imdb(root, split)
    if any(path.glob("*.parquet")):
        raise ClassifyError(f"{path} has no {split}.parquet (found: "
                            f"{', '.join(sorted(p.name for p in path.glob('*.parquet')))})")
    raise ClassifyError(f"{path} is neither a folder of parquet splits nor an aclImdb folder")


def _load_acl_imdb(root: Path, split: str) -> Examples:
    folder = "train" if split == "unsupervised" else split
    classes = [("unsup", -1)] if split == "unsupervised" else [("neg", 0), ("pos", 1)]
    texts, labels = [], []
    for name, label in classes:
        directory = root / folder / name
        if not directory.is_dir():
            raise ClassifyError(f"aclImdb folder {root} has no {folder}/{name}/")
        # Files are <id>_<rating>.txt; sort by numeric id for a stable order.
        files = sorted(directory.glob("*.txt"), key=lambda p: (int(p.stem.split("_")[0]) if p.stem.split("_")[0].isdigit() else 0, p.name))
        for file in files:
            texts.append(file.read_bytes().decode("utf-8", errors="replace"))
            labels.append(label)
    return Examples(texts, labels)


def _load_file(path: Path) -> Examples:
    """A local .parquet, .csv or .json / .jsonl file, read with pyarrow (parquet, CSV) or the standard library
    (JSON). Not through ``datasets.load_dataset``: it writes a copy of every local file it is given into its cache
    (~/.cache/huggingface/datasets; each new file another copy, a test session hundreds) and takes ~1.5 s to
    import; the hub needs it, a file on disk does not."""
    fmt = FILE_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ClassifyError(f"unsupported data file {path.name}: use .csv, .jsonl, .json or .parquet")
    import pyarrow as pa

    try:
        columns = _READERS[fmt](path)
    except (OSError, ValueError, pa.ArrowException) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ClassifyError(f"cannot read {path}: {str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
    return _from_columns(columns, str(path))


def _read_parquet(path: Path) -> dict[str, list]:
    """The ``text`` and ``label`` columns of a parquet file (``_columns_to_read``)."""
    import pyarrow.parquet as pq

    file = pq.ParquetFile(path)
    return file.read(columns=_columns_to_read(file.schema_arrow.names)).to_pydict()


def _read_csv(path: Path) -> dict[str, list]:
    """A CSV file with a header row; a quoted field may hold line breaks; ``text`` is read as text even where
    every value looks like a number."""
    import pyarrow as pa
    from pyarrow import csv

    return csv.read_csv(path, parse_options=csv.ParseOptions(newlines_in_values=True),
                        convert_options=csv.ConvertOptions(column_types={"text": pa.string()})).to_pydict()


def _read_json(path: Path) -> dict[str, list]:
    """JSON Lines (one object per line) or one JSON array of objects -> column name -> values (None where an
    object lacks the key)."""
    content = path.read_text(encoding="utf-8")
    if content.lstrip().startswith("["):
        records = json.loads(content)
    else:
        # split("\n"), not splitlines(): that also splits at U+2028 and other separators a JSON string may hold raw.
        records = [json.loads(line) for line in content.split("\n") if line.strip()]
    if not all(isinstance(record, dict) for record in records):
        raise ValueError("expected JSON objects with 'text' and 'label', one per line or in one array")
    # No objects at all: the columns are there, empty, so that the check says the file is empty.
    names = dict.fromkeys(name for record in records for name in record) or dict.fromkeys(("text", "label"))
    return {name: [record.get(name) for record in records] for name in names}


_READERS = {"parquet": _read_parquet, "csv": _read_csv, "json": _read_json}


def _columns_to_read(names: Sequence[str]) -> list[str]:
    """Of a table's columns, ``text`` and ``label``; all of them when ``text`` is missing, for the error to name
    them."""
    return [name for name in names if name in ("text", "label")] if "text" in names else list(names)


def _load_hub(name: str, split: str) -> Examples:
    datasets = _datasets()
    try:
        table = datasets.load_dataset(name, split=split)
    except Exception as err:
        raise ClassifyError(f"cannot load {name!r} split {split!r} from the Hugging Face hub "
                            f"(no network? pass a local folder with --data): {str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
    return _from_columns({column: table[column] for column in _columns_to_read(table.column_names)}, name)


def _datasets():
    """``datasets``, imported only when needed (it is slow to import), with its progress bars off."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def _from_columns(columns: Mapping[str, Sequence], where: str) -> Examples:
    """Column name -> values: ``text`` required, ``label`` optional (without it every text is unlabelled, -1)."""
    if "text" not in columns:
        raise ClassifyError(f"{where} has no 'text' column (columns: {', '.join(sorted(columns))})")
    texts = list(columns["text"])
    labels = list(columns["label"]) if "label" in columns else [-1] * len(texts)
    return Examples(texts, labels)


def _check(examples: Examples, where: str, num_classes: int, labelled: bool) -> Examples:
    if len(examples) == 0:
        raise ClassifyError(f"{where} is empty")
    labels = []
    for i, (text, label) in enumerate(zip(examples.texts, examples.labels)):
        if not isinstance(text, str):
            raise ClassifyError(f"{where}: row {i} has a non-text 'text' value ({text!r:.40})")
        if isinstance(label, str) and label.strip().lower() in LABEL_NAMES:
            label = LABEL_NAMES.index(label.strip().lower())
        try:
            value = int(label)
            if value != label and not isinstance(label, str):
                raise ValueError
        except (TypeError, ValueError):
            raise ClassifyError(f"{where}: row {i} has label {label!r}, expected an integer class") from None
        if labelled and not 0 <= value < num_classes:
            raise ClassifyError(f"{where}: row {i} has label {value}, expected 0..{num_classes - 1}")
        if not labelled and not -1 <= value < num_classes:
            raise ClassifyError(f"{where}: row {i} has label {value}, expected -1..{num_classes - 1}")
        labels.append(value)
    return Examples(examples.texts, labels)


# --------------------------------------------------------------------------- splits
def stratified_split(labels: list[int], val_size: int, seed: int) -> tuple[list[int], list[int]]:
    """Seeded stratified split of row indices into (train, validation) with ``val_size`` rows."""
    from sklearn.model_selection import train_test_split

    n = len(labels)
    if val_size <= 0:
        return list(range(n)), []
    if val_size >= n:
        raise ClassifyError(f"validation size {val_size} leaves no training data (only {n} examples)")
    counts = np.bincount(np.asarray(labels))
    stratify = labels if counts[counts > 0].min() >= 2 and val_size >= len(counts) else None
    train_idx, val_idx = train_test_split(np.arange(n), test_size=val_size, random_state=seed, stratify=stratify)
    return sorted(train_idx.tolist()), sorted(val_idx.tolist())


SPLITS_BY = ("grouped", "random")


def default_val_size(examples: int) -> int:
    """Validation examples carved from ``examples`` training examples when no size is asked for: 10%, at
    most 2,500 (IMDB's 25,000 give 2,500; ``--limit 3000`` gives 300 and trains on 2,700)."""
    return min(2500, examples // 10)


def sample(examples: Examples, limit: int | None, seed: int) -> Examples:
    """A seeded random sample of ``limit`` examples in file order (all of them if ``limit`` is None or larger);
    not the file's first rows: IMDB files are sorted by label."""
    if not limit or limit >= len(examples):
        return examples
    return examples.subset(sorted(np.random.default_rng(seed).permutation(len(examples))[:limit]))


def unlabelled_split(source: str, limit: int | None = None, seed: int = 0) -> Examples:
    """``source``'s unlabelled reviews (its unsupervised split; none if it has no such split), a seeded sample of
    ``limit`` of them if given."""
    if not provides_split(source, "unsupervised"):
        return Examples([], [])
    return sample(load_split(source, "unsupervised", labelled=False), limit, seed)


def training_split(source: str, val_size: int | None, seed: int, limit: int | None = None,
                   split: str = "grouped") -> tuple[Examples, Examples]:
    """The (train, validation) examples of a run: ``source``'s train split, cut to a seeded sample of
    ``limit`` reviews if given, then split (``val_size`` None: ``default_val_size``). ``classify.train``
    trains on exactly this, and ``classify.evaluate --baseline`` rebuilds it from a run's config.json.

    ``split="grouped"`` keeps reviews of one movie on one side (``classify.text.review_groups``), so that
    validation accuracy predicts test accuracy; ``"random"`` is the stratified random split of runs
    made before grouping existed (it shares movies with training and flatters the model).
    """
    from .review_groups import grouped_split, review_groups

    if split not in SPLITS_BY:
        raise ClassifyError(f"split must be one of {', '.join(SPLITS_BY)}, got {split!r}")
    full = sample(load_split(source, "train"), limit, seed)
    if val_size is None:
        val_size = default_val_size(len(full))
    if split == "random":
        train_idx, val_idx = stratified_split(full.labels, val_size, seed)
    else:
        groups, _ = review_groups(full.texts, full.labels)
        train_idx, val_idx = grouped_split(full.labels, groups, val_size, seed)
    return full.subset(train_idx), full.subset(val_idx)
