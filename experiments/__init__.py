"""Experiments run on top of ``classify``: benchmarks and the studies behind the defaults.

Run them from the repository root as modules, e.g. ``python -m experiments.bench --quick``.
Their reports go to ``experiments/runs/results/`` (git-ignored) unless asked to ``--record`` them in
``experiments/results/``, the tracked folder the RESULTS*.md write-ups cite: trying a benchmark
leaves the checkout clean.
"""

from __future__ import annotations

import argparse
from pathlib import Path

RECORDED = Path(__file__).resolve().parent / "results"
SCRATCH = Path(__file__).resolve().parent / "runs" / "results"


def add_results_args(parser: argparse.ArgumentParser, what: str) -> None:
    """--results and --record: where an experiment's report (``what``) goes."""
    parser.add_argument("--results", type=Path,
                        help=f"folder for {what} (default: experiments/runs/results/, untracked; with --record: "
                             f"experiments/results/)")
    parser.add_argument("--record", action="store_true",
                        help="write into experiments/results/ (tracked; the RESULTS*.md write-ups cite it)")


def results_folder(args: argparse.Namespace) -> Path:
    return args.results or (RECORDED if args.record else SCRATCH)
