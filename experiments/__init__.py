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


def scoring_args(module: str, description: str, argv: list[str]) -> argparse.Namespace:
    """The parsed flags of an experiment ``experiments.NAME`` that scores trained runs: --runs, --counterfactual,
    --threads (set as torch's), --name (its report's file name, default NAME) and where the report goes."""
    import torch

    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", type=Path, required=True, help="classifier run folders")
    parser.add_argument("--counterfactual", metavar="PATH", help="counterfactual pairs (../shared/imdb-counterfactual)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--name", default=module.rsplit(".", 1)[-1], help="the report's file name")
    add_results_args(parser, "NAME.json and .md")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    return args


def results_folder(args: argparse.Namespace) -> Path:
    return args.results or (RECORDED if args.record else SCRATCH)
