"""Reading reviews to classify: command-line texts, stdin, text/JSONL/CSV files, folders of ``.txt`` files.

Every input becomes a :class:`Review`, in input order, read lazily so that files of any
size stream through in bounded memory. A problem with one review never stops the others;
it becomes that review's ``error`` (or a ``note`` when the review can still be used):

* invalid UTF-8: decoded with U+FFFD replacement characters, plus a note;
* NUL bytes (a binary file in a folder, a stray binary line): error;
* empty or whitespace-only: error;
* longer than ``MAX_REVIEW_CHARS``: error (the line or file is skipped without being held
  in memory; anything shorter is read, and the model's truncation applies later).

Problems with an input as a whole (missing file, unknown format, a binary file given as
``--file``, a CSV without a ``text`` column) raise ClassifyError before anything is read.
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, TextIO

from ..errors import ClassifyError

MAX_REVIEW_CHARS = 16 * 2**20  # far beyond any real review; bounds the memory one input line can take
FORMATS = ("auto", "text", "jsonl", "csv")
SUFFIXES = {".txt": "text", ".text": "text", "": "text", ".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv"}
_SNIFF_BYTES = 8192
_SURROGATE = re.compile("[\ud800-\udfff]")  # undecodable bytes, kept by errors="surrogateescape"


@dataclass
class Review:
    """One input: its text, or why it cannot be classified."""

    id: int                      # 0-based position in the input
    source: str                  # where it came from, for people: "argument 2", "reviews.txt:17", a path
    text: str | None             # None when ``error`` is set
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    nbytes: int = 0              # input bytes it took up (drives the progress bar)


@dataclass
class Inputs:
    """The reviews of one invocation, still unread, and what is known up front."""

    reviews: Iterator[Review]
    total_bytes: int | None      # None when reading stdin (size unknown)
    notes: list[str]             # about the inputs as a whole, e.g. files skipped in a folder


def open_inputs(texts: list[str], file: str | None, fmt: str, stdin: TextIO) -> Inputs:
    """Check every input source now (so mistakes fail before the model loads); read them lazily.

    ``texts``: reviews given as arguments, ``-`` meaning stdin (one review per line, or ``fmt``).
    ``file``: a text/JSONL/CSV file or a folder of ``.txt`` files. With neither, stdin is read
    unless it is a terminal.
    """
    if not texts and file is None:
        if stdin.isatty():
            raise ClassifyError("nothing to classify: give reviews as arguments, --file PATH, or pipe them to stdin")
        texts = ["-"]
    if texts.count("-") > 1:
        raise ClassifyError("'-' (stdin) can be given only once")
    sources: list[Iterator[tuple[str, str | None, str | None, int]]] = []
    total: int | None = 0
    notes: list[str] = []
    for i, text in enumerate(texts, 1):
        if text == "-":
            sources.append(_read_stream(_text_stream(stdin), "stdin", "text" if fmt == "auto" else fmt))
            total = None
        else:
            nbytes = _nbytes(text)
            sources.append(iter([(f"argument {i}", text, None, nbytes)]))
            total = None if total is None else total + nbytes
    if file is not None:
        path = Path(file).expanduser()
        if path.is_dir():
            files, skipped = _folder_files(path)
            if skipped:
                notes.append(f"{path}: skipped {skipped} file(s) that do not end in .txt")
            sources.append(_read_folder(files))
            total = None if total is None else total + sum(f.stat().st_size for f in files)
        else:
            file_format = _file_format(path, fmt)
            sources.append(_read_file(path, file_format))
            total = None if total is None else total + path.stat().st_size
    return Inputs(_numbered(sources), total, notes)


# ------------------------------------------------------------------ per-review checks
def _numbered(sources) -> Iterator[Review]:
    """Give every (source, text, error, nbytes) item its position and its per-review checks."""
    i = 0
    for items in sources:
        for source, text, error, nbytes in items:
            yield _review(i, source, text, error, nbytes)
            i += 1


def _review(i: int, source: str, text: str | None, error: str | None, nbytes: int) -> Review:
    if error is not None or text is None:
        return Review(i, source, None, error or "no text", nbytes=nbytes)
    notes = []
    if _SURROGATE.search(text):
        # One U+FFFD per undecodable byte: the rest of the review is still worth classifying.
        text = _SURROGATE.sub("\ufffd", text)
        notes.append("invalid UTF-8 bytes were replaced by U+FFFD")
    if "\x00" in text:
        return Review(i, source, None, "contains NUL bytes: binary data, not text", notes, nbytes)
    if not text.strip():
        return Review(i, source, None, "empty review", notes, nbytes)
    return Review(i, source, text, None, notes, nbytes)


# ------------------------------------------------------------------------- sources
def _file_format(path: Path, fmt: str) -> str:
    if not path.exists():
        raise ClassifyError(f"input file not found: {path}")
    if not path.is_file():
        raise ClassifyError(f"{path} is neither a file nor a folder")
    if fmt == "auto":
        fmt = SUFFIXES.get(path.suffix.lower(), "")
        if not fmt:
            raise ClassifyError(f"cannot read {path.name}: unknown format {path.suffix!r}; use .txt (one review per "
                                f"line), .jsonl (a 'text' field), .csv (a 'text' column), a folder of .txt files, "
                                f"or --format")
    with open(path, "rb") as f:
        head = f.read(_SNIFF_BYTES)
    if not head:
        raise ClassifyError(f"{path} is empty")
    if b"\x00" in head:
        raise ClassifyError(f"{path} looks like a binary file (it contains NUL bytes), not {fmt}; "
                            f"UTF-16 text must be converted to UTF-8 first")
    return fmt


def _read_file(path: Path, fmt: str) -> Iterator[tuple[str, str | None, str | None, int]]:
    binary = open(path, "rb")
    try:
        items = _read_stream(_text_stream(binary), str(path), fmt)
    except BaseException:
        binary.close()
        raise
    return _closing(items, binary)


def _closing(items: Iterator, resource: BinaryIO) -> Iterator:
    try:
        yield from items
    finally:
        resource.close()


def _text_stream(stream: TextIO | BinaryIO) -> TextIO:
    """UTF-8 text (BOM dropped) that keeps undecodable bytes as surrogates for ``_review`` to report."""
    binary = getattr(stream, "buffer", stream)
    if isinstance(binary, io.TextIOBase):  # a text-only stream (e.g. StringIO): already decoded
        return binary
    return io.TextIOWrapper(binary, encoding="utf-8-sig", errors="surrogateescape", newline="")


def _read_stream(stream: TextIO, name: str, fmt: str) -> Iterator[tuple[str, str | None, str | None, int]]:
    """Items of a text/JSONL/CSV stream; a CSV header is checked now, the rows are read lazily."""
    return _read_csv(stream, name) if fmt == "csv" else _read_lines(stream, name, fmt)


def _read_lines(stream: TextIO, name: str, fmt: str) -> Iterator[tuple[str, str | None, str | None, int]]:
    for lineno, line, nbytes in _lines(stream):
        source = f"{name}:{lineno}"
        if line is None:
            yield source, None, f"line longer than {MAX_REVIEW_CHARS} characters; skipped", nbytes
        elif fmt == "text":
            # Blank lines are reported (as empty reviews) so that output N is always input line N.
            yield source, line.rstrip("\r\n"), None, nbytes
        elif line.strip():  # JSONL: blank lines separate nothing and are skipped
            text, error = _json_text(line)
            yield source, text, error, nbytes


def _lines(stream: TextIO) -> Iterator[tuple[int, str | None, int]]:
    """(line number, line with its newline or None when too long, bytes) in bounded memory."""
    lineno = 0
    while line := stream.readline(MAX_REVIEW_CHARS + 1):
        lineno += 1
        nbytes = _nbytes(line)
        if len(line) > MAX_REVIEW_CHARS and not line.endswith("\n"):
            while line and not line.endswith("\n"):  # skip the rest of the overlong line
                line = stream.readline(MAX_REVIEW_CHARS)
                nbytes += _nbytes(line)
            yield lineno, None, nbytes
        else:
            yield lineno, line, nbytes


def _nbytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogateescape")) if not text.isascii() else len(text)


def _json_text(line: str) -> tuple[str | None, str | None]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        return None, f"invalid JSON: {err}"
    if not isinstance(record, dict) or "text" not in record:
        return None, "JSON line has no 'text' field"
    if not isinstance(record["text"], str):
        return None, f"'text' is not a string but {type(record['text']).__name__}"
    return record["text"], None


def _read_csv(stream: TextIO, name: str) -> Iterator[tuple[str, str | None, str | None, int]]:
    consumed, overlong = 0, False

    def lines() -> Iterator[str]:
        nonlocal consumed, overlong
        for _, line, nbytes in _lines(stream):
            consumed += nbytes
            overlong = line is None
            yield "\n" if line is None else line  # an overlong line reads as a blank row, reported below

    csv.field_size_limit(max(csv.field_size_limit(), MAX_REVIEW_CHARS))
    reader = csv.reader(lines())
    try:
        header = next(reader, [])
    except csv.Error as err:
        raise ClassifyError(f"{name} is not a readable CSV file: {err}") from None
    if "text" not in header:
        raise ClassifyError(f"{name} has no 'text' column (columns: {', '.join(header) or 'none'})")

    def rows() -> Iterator[tuple[str, str | None, str | None, int]]:
        column, used, start = header.index("text"), consumed, reader.line_num + 1
        while True:
            try:
                row = next(reader)
            except StopIteration:
                return
            except csv.Error as err:
                row, error = None, f"unreadable CSV row: {err}"
            else:
                error = None if len(row) > column else "row has no 'text' value"
            if row == [] and overlong:
                error = f"line longer than {MAX_REVIEW_CHARS} characters; skipped"
            elif row == []:  # a blank line between rows: not a review
                start, used = reader.line_num + 1, consumed
                continue
            yield f"{name}:{start}", None if error else row[column], error, consumed - used
            start, used = reader.line_num + 1, consumed

    return rows()


def _folder_files(folder: Path) -> tuple[list[Path], int]:
    """All ``.txt`` files under ``folder`` (recursively, hidden ones excluded) and the number of others."""
    files, skipped = [], 0
    for path in sorted(folder.rglob("*")):
        if any(part.startswith(".") for part in path.relative_to(folder).parts) or not path.is_file():
            continue
        if path.suffix.lower() == ".txt":
            files.append(path)
        else:
            skipped += 1
    if not files:
        raise ClassifyError(f"{folder} contains no .txt files to classify")
    return files, skipped


def _read_folder(files: list[Path]) -> Iterator[tuple[str, str | None, str | None, int]]:
    for path in files:
        size = path.stat().st_size
        if size > MAX_REVIEW_CHARS * 4:  # even at 4 bytes a character it is over the limit
            yield str(path), None, f"file is {size / 2**20:.0f} MiB, too large for a review; skipped", size
            continue
        try:
            data = path.read_bytes()
        except OSError as err:
            yield str(path), None, f"cannot read: {err.strerror or err}", size
            continue
        text = data.decode("utf-8", "surrogateescape").removeprefix("\ufeff")
        if len(text) > MAX_REVIEW_CHARS:
            yield str(path), None, f"longer than {MAX_REVIEW_CHARS} characters; skipped", size
        else:
            yield str(path), text, None, size
