"""python -m classify.predict: the sentiment of reviews, from a trained run folder.

    python -m classify.predict "A wonderful film." "Two hours I will never get back."
    python -m classify.predict --file reviews.txt --output predictions.csv
    python -m classify.predict --format jsonl --json - < reviews.jsonl
    python -m classify.predict --explain --explain-html why.html "Great cast, awful script."

Reviews are read lazily (``classify.text.inputs``) and classified in chunks, each batched and
length-bucketed by ``inference.classify_texts``, so files of any size stream through in
bounded memory; results come out in input order. A review that cannot be classified gets a
per-item error and the others are still predicted. ``--backend onnx`` runs a folder written by
``classify.export`` on ONNX Runtime instead of PyTorch (explanations need PyTorch).
"""

from __future__ import annotations

import argparse
import csv
import html
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from .engine.config import HelpFormatter, InferenceConfig, add_flags
from .engine.files import atomic_path, write_text
from .engine.progress import progress_bar
from .errors import ClassifyError, run_cli
from .explain import Explanation, explain, explained_class, legend, to_html, to_rich
from .inference import RUNS_DIR, LoadedRun, classify_texts, open_run
from .text.inputs import FORMATS, Inputs, Review, open_inputs

CHUNK_REVIEWS = 1024          # reviews classified together: enough for good length buckets
CHUNK_CHARS = 16 * 2**20      # ... and a bound on the text held at once
EXCERPT_CHARS = 70
OUTPUT_FORMATS = {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl"}


# ----------------------------------------------------------------------- prediction
@dataclass
class Prediction:
    """The outcome for one review: probabilities, or an error; notes either way."""

    review: Review
    probabilities: np.ndarray | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    text: str = ""                 # the review as read (after ``Preprocessing.clip``)
    excerpt: str = ""
    explanation: Explanation | None = None

    label: str = ""
    score: float = 0.0


def predict_chunk(run: LoadedRun, reviews: list[Review], batch_size: int,
                  progress: Callable[[int], None] | None = None) -> list[Prediction]:
    """Classify ``reviews`` (one chunk) in input order; unusable ones get their error."""
    predictions = [Prediction(review, error=review.error, notes=list(review.notes)) for review in reviews]
    readable = [p for p in predictions if p.review.text is not None]
    results = classify_texts(run, [p.review.text for p in readable], batch_size, progress)
    for prediction, result in zip(readable, results):
        prediction.notes += result.notes
        if result.probabilities is None:
            prediction.error = "no text left once HTML markup is removed"
            continue
        prediction.probabilities, prediction.text = result.probabilities, result.text
        prediction.label, prediction.score = result.label, result.score
        prediction.excerpt = result.normalized if len(result.normalized) <= EXCERPT_CHARS else \
            result.normalized[: EXCERPT_CHARS - 1] + "…"
    return predictions


def chunks(reviews: Iterable[Review]) -> Iterator[list[Review]]:
    chunk: list[Review] = []
    chars = 0
    for review in reviews:
        chunk.append(review)
        chars += len(review.text or "")
        if len(chunk) >= CHUNK_REVIEWS or chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


# -------------------------------------------------------------------------- outputs
def record(prediction: Prediction, labels: list[str]) -> dict:
    """The JSON object for one input: ``id``, ``source``, then ``label``/``score``/``probabilities``
    or ``error``, then ``notes`` (and ``explanation`` with --explain)."""
    out: dict = {"id": prediction.review.id, "source": prediction.review.source}
    if prediction.error is not None:
        out["error"] = prediction.error
    else:
        out.update(label=prediction.label, score=round(prediction.score, 6),
                   probabilities={name: round(float(p), 6) for name, p in zip(labels, prediction.probabilities)})
    out["notes"] = prediction.notes
    if prediction.explanation is not None:
        out["explanation"] = {"target": labels[prediction.explanation.target],
                              "words": [[w, round(s, 4)] for w, s in prediction.explanation.word_scores()]}
    return out


class JsonLinesWriter:
    def __init__(self, stream: TextIO, labels: list[str]):
        self.stream, self.labels = stream, labels

    def write(self, predictions: list[Prediction]) -> None:
        for prediction in predictions:
            self.stream.write(json.dumps(record(prediction, self.labels), ensure_ascii=False) + "\n")
        self.stream.flush()

    def close(self) -> None:
        pass


class CsvWriter:
    def __init__(self, stream: TextIO, labels: list[str]):
        self.labels = labels
        self.writer = csv.writer(stream)
        self.writer.writerow(["id", "source", "label", "score", *(f"p_{name}" for name in labels), "error", "notes"])

    def write(self, predictions: list[Prediction]) -> None:
        for prediction in predictions:
            r = record(prediction, self.labels)
            probabilities = r.get("probabilities", {})
            self.writer.writerow([r["id"], r["source"], r.get("label", ""), r.get("score", ""),
                                  *(probabilities.get(name, "") for name in self.labels),
                                  r.get("error", ""), "; ".join(r["notes"])])

    def close(self) -> None:
        pass


class TableWriter:
    """A rich table (and coloured explanations) for people, printed once all reviews are in."""

    def __init__(self, console: Console, labels: list[str]):
        self.console, self.labels = console, labels
        self.table = Table("source", "label", "probability", "review")
        self.panels: list[Panel] = []

    def write(self, predictions: list[Prediction]) -> None:
        for p in predictions:
            # Text objects, not strings: review text must never be parsed as rich markup.
            notes = Text("".join(f"\n({note})" for note in p.notes), style="dim")
            source = Text(p.review.source)
            if p.error is not None:
                self.table.add_row(source, Text("error", style="bold red"), "", Text(p.error, style="red") + notes)
                continue
            self.table.add_row(source, Text(p.label, style="bold"), f"{p.score:.3f}", Text(p.excerpt) + notes)
            if p.explanation is not None:
                green, red = legend(self.labels, p.explanation.target)
                title = Text(f"{p.review.source}: {p.label} {p.score:.3f}")
                self.panels.append(Panel(to_rich(p.explanation), title=title, subtitle=f"green: {green}, red: {red}",
                                         title_align="left"))

    def close(self) -> None:
        self.console.print(self.table)
        for panel in self.panels:
            self.console.print(panel)


class HtmlWriter:
    """``--explain-html``: one snippet per explained review, written when done."""

    def __init__(self, path: Path, labels: list[str], steps: int):
        self.path = path
        method = "gradient x input" if steps == 1 else f"integrated gradients ({steps} steps)"
        green, red = legend(labels, 1) if len(labels) == 2 else ("towards the predicted label", "against it")
        self.parts = [f'<p class="classify-legend">Word attributions by {method} on the token embeddings: '
                      f'<span style="background-color:rgb(100,255,100)">green</span> pushed {html.escape(green)}, '
                      f'<span style="background-color:rgb(255,100,100)">red</span> {html.escape(red)}, whatever '
                      f'the answer. Hover over a word for its score.</p>\n']

    def write(self, predictions: list[Prediction]) -> None:
        for p in predictions:
            if p.explanation is not None:
                self.parts.append(to_html(p.explanation, f"{p.review.source}: {p.label} ({p.score:.1%})"))

    def close(self) -> None:
        write_text(self.path, "".join(self.parts))


def classify_all(run: LoadedRun, inputs: Inputs, writers: list, batch_size: int, explain_steps: int | None,
                 show_bar: bool) -> dict[str, int]:
    """Stream every review through ``predict_chunk`` (and ``explain`` when ``explain_steps`` is set)
    into ``writers``, chunk by chunk, with a progress bar over the input bytes."""
    counts = {"predicted": 0, "errors": 0}
    done_bytes = 0
    with progress_bar(inputs.total_bytes, show_bar) as update:
        for chunk in chunks(inputs.reviews):
            chunk_bytes = sum(r.nbytes for r in chunk)
            n_before = counts["predicted"] + counts["errors"]

            def advance(n: int, size: int = len(chunk)) -> None:
                update(done_bytes + chunk_bytes * n / size, f"{n_before + n} reviews")

            predictions = predict_chunk(run, chunk, batch_size, advance)
            for prediction in predictions:
                counts["errors" if prediction.error else "predicted"] += 1
                if explain_steps is not None and prediction.error is None:
                    target = explained_class(prediction.probabilities)
                    prediction.explanation = explain(run, prediction.text, target, explain_steps,
                                                     run.backend.device)
            for writer in writers:
                writer.write(predictions)
            done_bytes += chunk_bytes
            update(done_bytes, f"{n_before + len(chunk)} reviews")
    return counts


# ------------------------------------------------------------------------------ CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m classify.predict",
        description="Classify the sentiment of reviews with a trained run. A review that cannot be classified "
                    "(empty, only markup, binary, unreadable, over the size limit) gets a per-item error and "
                    "the rest are still predicted; exit status 0 unless the run or an input as a whole is "
                    "unusable (then one line on stderr and status 2).",
        formatter_class=HelpFormatter,
    )
    p.add_argument("texts", nargs="*", metavar="TEXT",
                   help="reviews to classify; '-' reads stdin (one review per line). With no TEXT and no --file, "
                        "stdin is read when it is not a terminal")
    g = p.add_argument_group("input")
    g.add_argument("--file", help="a .txt file (one review per line), .jsonl (a 'text' field per line), .csv "
                                  "(a 'text' column), or a folder of .txt files (one review each, recursively)")
    g.add_argument("--format", choices=FORMATS, default="auto",
                   help="format of --file and stdin; auto = by extension (stdin: text)")
    g = p.add_argument_group("model")
    g.add_argument("--model", help=f"run folder, or with --backend onnx a folder written by classify.export "
                                   f"(default: the newest of its kind under {RUNS_DIR}/)")
    add_flags(g, InferenceConfig)
    g.add_argument("--batch-size", type=int, default=64, help="reviews per forward pass (length-bucketed)")
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true",
                   help="one JSON object per input on stdout: id, source, label, score, probabilities, notes "
                        "(or id, source, error, notes)")
    g.add_argument("--output", help="also write all results to this .csv or .jsonl file (then stdout shows "
                                    "nothing unless --json)")
    g.add_argument("--explain", action="store_true",
                   help="show which words pushed each decision (coloured text; 'explanation' in JSON output; "
                        "--backend torch only)")
    g.add_argument("--explain-html", metavar="FILE", help="write the explanations as an HTML snippet (implies --explain)")
    g.add_argument("--explain-steps", type=int, default=32,
                   help="integrated-gradients steps per review; 1 = plain gradient x input (cheapest)")
    g.add_argument("--quiet", action="store_true", help="no progress bar and no messages on stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.batch_size <= 0 or args.explain_steps <= 0:
        raise ClassifyError("--batch-size and --explain-steps must be positive")
    output_format = None
    if args.output is not None:
        output_format = OUTPUT_FORMATS.get(Path(args.output).suffix.lower())
        if output_format is None:
            raise ClassifyError(f"--output {args.output}: use a .csv or .jsonl file name")
    explaining = args.explain or args.explain_html is not None
    if explaining and args.backend != "torch":
        raise ClassifyError(f"--explain needs the PyTorch model (gradients); --backend {args.backend} has none: "
                            f"explain with --backend torch and the run folder")
    console = Console(stderr=True, quiet=args.quiet)
    inputs = open_inputs(args.texts, args.file, args.format, sys.stdin)
    run = open_run(args.model, args, console)
    for note in inputs.notes:
        console.print(f"note: {escape(note)}")

    start = time.monotonic()
    with ExitStack() as stack:
        writers: list = []
        if args.json:
            writers.append(JsonLinesWriter(sys.stdout, run.labels))
        elif args.output is None:
            writers.append(TableWriter(Console(), run.labels))
        if args.output is not None:
            tmp = stack.enter_context(atomic_path(args.output))  # no half-written file on failure
            stream = stack.enter_context(open(tmp, "w", encoding="utf-8", newline=""))
            writers.append((CsvWriter if output_format == "csv" else JsonLinesWriter)(stream, run.labels))
        if args.explain_html is not None:
            writers.append(HtmlWriter(Path(args.explain_html), run.labels, args.explain_steps))
        # A bar drawn between JSON lines on the same terminal would garble them.
        show_bar = not args.quiet and not (args.json and sys.stdout.isatty())
        counts = classify_all(run, inputs, writers, args.batch_size, args.explain_steps if explaining else None,
                              show_bar)
        if not counts["predicted"] + counts["errors"]:
            raise ClassifyError("no reviews in the input")
        for writer in writers:  # after the progress bar is gone: the table prints here
            writer.close()

    seconds = time.monotonic() - start
    total = counts["predicted"] + counts["errors"]
    console.print(f"{counts['predicted']} of {total} reviews classified"
                  + (f", {counts['errors']} could not be (see their errors)" if counts["errors"] else "")
                  + f" in {seconds:.1f}s ({total / max(seconds, 1e-9):.0f}/s)")
    for path in (args.output, args.explain_html):
        if path is not None:
            console.print(f"wrote {escape(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, prog="classify.predict"))
