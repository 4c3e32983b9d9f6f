"""How trained runs read short texts: the behavioural suite and the held-out edited reviews, side by side.

    python -m experiments.behaviour --runs runs/before runs/imdb --counterfactual ../shared/imdb-counterfactual --record

For each run and each of its systems (the model, and with an n-gram branch each branch alone): the failure rate of
every capability of ``classify.behaviour`` (short typed sentences: negation, contrast, a closing verdict, ...; and
perturbations that must not change the answer), and with ``--counterfactual`` the accuracy on the held-out
counterfactual pairs (``classify.text.counterfactual``: IMDB training reviews and their revisions, edited so that the
label flips; the revisions are never trained on). The same numbers as ``classify.evaluate`` reports for one run;
here several runs share one table. The suite is a test set: nothing is tuned on it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from classify.evaluate import behaviour_report, counterfactual_report, system_predictors
from classify.inference import load_run

from . import results_folder, scoring_args
from .trainruns import experiment_meta, write_results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = scoring_args("experiments.behaviour", __doc__, argv)
    device = torch.device("cpu")

    results = {}
    for path in args.runs:
        run = load_run(path, device)   # fp32 (no autocast): the same answers on CPUs with and without bf16
        predict = system_predictors(run, 64)
        results[str(path)] = {"behaviour": behaviour_report(predict, seed=0)}
        if args.counterfactual:
            results[str(path)]["counterfactual"] = counterfactual_report(args.counterfactual, predict)

    columns = [(run, system) for run, r in results.items() for system in r["behaviour"]["systems"]]
    first = results[columns[0][0]]["behaviour"]["systems"][columns[0][1]]["capabilities"]
    lines = [f"# Behaviour of {len(results)} run(s)", "", f"`{experiment_meta('experiments.behaviour', argv)['command']}`",
             "", "Failure rates (mft: a labelled sentence answered wrong; inv: an answer changed by a perturbation "
             "that should not change it); counterfactual: accuracy on the held-out pairs.", "",
             "| | " + " | ".join(f"{Path(run).name}: {system}" for run, system in columns) + " |",
             "|---|" + "---|" * len(columns)]

    def cell(run: str, system: str, key: str | None) -> str:
        s = results[run]["behaviour"]["systems"][system]
        value = s["failure_rate"]["all"] if key is None else s["capabilities"][key]["failure_rate"]
        return f"{100 * value:.1f}%"

    lines.append("| all capabilities | " + " | ".join(cell(r, s, None) for r, s in columns) + " |")
    for name, c in first.items():
        lines.append(f"| {name} ({c['kind']}, {c['cases']}) | " + " | ".join(cell(r, s, name) for r, s in columns) + " |")
    if args.counterfactual:
        for key in ("original", "revised", "both"):
            lines.append(f"| counterfactual {key} | " + " | ".join(
                f"{100 * results[r]['counterfactual']['systems'][s][key]:.1f}%" for r, s in columns) + " |")
    record = {**experiment_meta("experiments.behaviour", argv), "threads": args.threads, "runs": results}
    write_results(results_folder(args), args.name, record, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
