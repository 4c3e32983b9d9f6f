"""What reading typing slips as the words meant (``classify.text.spelling``) changes, on runs already trained.

    python -m experiments.spelling --runs runs/imdb runs/imdb-seed1 --counterfactual ../shared/imdb-counterfactual \\
        --threads 2 --record

Each run is scored twice with the same weights, reading its texts as trained (``--no-spelling`` for runs from
before the setting) and with the correction switched on at inference only: accuracy on its own validation reviews
(the split its training made; the number to steer by), on the test split, the behavioural suite's failure rates and
the held-out edited reviews, for the model and each branch alone; and how many texts had a word corrected.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import torch

from classify.evaluate import (behaviour_report, counterfactual_report, run_probabilities, run_training_split,
                               system_predictors)
from classify.inference import LoadedRun, load_run
from classify.text.data import load_split, normalize

from . import results_folder, scoring_args
from .trainruns import experiment_meta, write_results


def accuracies(run: LoadedRun, texts: list[str], labels: list[int]) -> dict[str, float]:
    """Accuracy of the model and each branch alone on ``texts``."""
    probabilities, _ = run_probabilities(run, texts, 64)
    y = np.asarray(labels)
    return {name: float((p.argmax(axis=1) == y).mean()) for name, p in probabilities.items()}


def corrected_share(run: LoadedRun, texts: list[str]) -> float:
    """The fraction of ``texts`` in which the run's preprocessing read at least one word as another."""
    tokens = run.preprocessing.tokens([normalize(t) for t in texts])
    return sum(bool(fixes) for _, _, fixes in tokens) / max(1, len(texts))


def score(run: LoadedRun, val, test, counterfactual: str | None) -> dict:
    predict = system_predictors(run, 64)
    out = {"validation": accuracies(run, val.texts, val.labels), "test": accuracies(run, test.texts, test.labels),
           "corrected": {"validation": corrected_share(run, val.texts), "test": corrected_share(run, test.texts)},
           "behaviour": behaviour_report(predict, seed=0)}
    if counterfactual:
        out["counterfactual"] = counterfactual_report(counterfactual, predict)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = scoring_args("experiments.spelling", __doc__, argv)

    results: dict[str, dict] = {}
    for path in args.runs:
        run = load_run(path, torch.device("cpu"))   # fp32: the same answers on CPUs with and without bf16
        _, val = run_training_split(run.config, None)
        test = load_split(run.config["train"]["data"], "test")
        results[str(path)] = {}
        for spelling in (False, True):
            run.preprocessing = dataclasses.replace(run.preprocessing, spelling=spelling)
            results[str(path)]["on" if spelling else "off"] = score(run, val, test, args.counterfactual)

    def pct(x: float) -> str:
        return f"{100 * x:.2f}%"

    lines = [f"# Typing slips read as the words meant, on {len(results)} run(s) (weights unchanged)", "",
             f"`{experiment_meta('experiments.spelling', argv)['command']}`", "",
             "| run | correction | texts corrected: validation / test | validation: model / transformer alone | "
             "IMDB test: model / transformer alone | suite failures: all / typos | held-out revisions |",
             "|---|---|---|---|---|---|---|"]
    for path, by in results.items():
        for key, r in by.items():
            systems = r["behaviour"]["systems"]["model"]
            revisions = r["counterfactual"]["systems"]["model"]["revised"] if "counterfactual" in r else None
            lines.append(f"| {Path(path).name} | {key} | {pct(r['corrected']['validation'])} / "
                         f"{pct(r['corrected']['test'])} | {pct(r['validation']['model'])} / "
                         f"{pct(r['validation'].get('transformer alone', float('nan')))} | {pct(r['test']['model'])} / "
                         f"{pct(r['test'].get('transformer alone', float('nan')))} | "
                         f"{pct(systems['failure_rate']['all'])} / {pct(systems['capabilities']['typos']['failure_rate'])}"
                         f" | {pct(revisions) if revisions is not None else '-'} |")
    record = {**experiment_meta("experiments.spelling", argv), "threads": args.threads, "runs": results}
    write_results(results_folder(args), args.name, record, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
