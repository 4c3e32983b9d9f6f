"""MLM pretraining on IMDB's own text, then fine-tuning, with accuracy against pretraining time.

    python -m experiments.pretraining --data ../shared/imdb                  # the recorded run
    python -m experiments.pretraining --data ../shared/imdb --reuse          # tabulate (and finish) runs

One ``classify.pretrain`` run of ``--pretrain-budget`` minutes. While it runs, a copy of its best
weights is taken at each of ``--snapshots`` minutes of pretraining. When it ends, every copy and
the final weights are fine-tuned with the same ``classify.train --init-from`` recipe for
``--finetune-budget`` minutes (``--parallel`` at a time) and evaluated once on the test split.
The table is test accuracy against minutes of pretraining. Results:
experiments/results/pretraining.json and .md, beside the supervised-only numbers from
experiments/results/seeds.json and the TF-IDF baseline from experiments/results/baseline.json
where those exist.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path

from classify.engine.runfolder import METRICS, WEIGHTS

from . import RECORDED, add_results_args, results_folder
from .trainruns import (evaluations, experiment_meta, shown, start_training, test_metrics, train_command, wait_all,
                        write_results)

# Pretraining: no dropout (the model is far from overfitting 18M tokens) and 2k-token batches (more, smaller
# steps): the second recorded run fell further per minute than the first, defaults-based one, though under less
# machine load (experiments/RESULTS_pretrain.md).
PRETRAIN_RECIPE = ["--dropout", "0", "--max-tokens", "2048", "--warmup", "300", "--epochs", "4",
                   "--eval-every", "500", "--save-every", "200"]
# Fine-tuning: between from-scratch (1e-3) and the BERT-style default (3e-4), short warmup for a short budget.
FINETUNE_RECIPE = ["--lr", "5e-4", "--warmup", "100", "--attention-dropout", "0", "--eval-every", "150"]
# What a fine-tuning run needs from a pretraining run (last/, the resume state, is not).
RUN_FILES = ("config.json", "tokenizer.json", "model.safetensors", "metrics.jsonl")


def snapshot_name(minutes: float) -> str:
    return f"pretrain-at-{minutes:g}min"


def pretrain_flags(args: argparse.Namespace) -> list[str]:
    return ["--data", args.data, "--time-budget", str(args.pretrain_budget), "--threads", str(args.threads),
            "--quiet", *PRETRAIN_RECIPE, *shlex.split(args.pretrain_args)]


def copy_run(run: Path, to: Path) -> None:
    """A fine-tunable copy of ``run`` as it is now (its files are replaced atomically, so each copy is whole)."""
    to.mkdir(parents=True, exist_ok=True)
    for name in RUN_FILES:
        shutil.copy2(run / name, to / name)


def weights_saved(run: Path, records: list[dict]) -> bool:
    """Whether ``model.safetensors`` already holds the best weights as of the newest evaluation record
    (the trainer writes the record first, then, if the loss improved, the weights)."""
    weights = run / WEIGHTS
    if not weights.exists():
        return False
    if len(records) > 1 and records[-1]["val_loss"] >= min(r["val_loss"] for r in records[:-1]):
        return True  # not an improvement: the saved weights are an earlier, better evaluation's
    return weights.stat().st_mtime_ns >= (run / METRICS).stat().st_mtime_ns


def pretrain_with_snapshots(run: Path, args: argparse.Namespace) -> None:
    """Run (or resume) the pretraining; copy it to ``snapshot_name(m)`` at its first evaluation after
    ``m`` minutes. Only evaluations made by this process count: a finished run resumed is not copied."""
    earlier = len(evaluations(run))
    pending = sorted(m for m in args.snapshots if not (run.parent / snapshot_name(m)).exists())
    training = start_training("pretraining", run, pretrain_flags(args), args.threads, "classify.pretrain")
    while training.process.poll() is None:
        records = evaluations(run)
        if (pending and len(records) > earlier and records[-1]["elapsed_s"] / 60 >= pending[0]
                and weights_saved(run, records)):
            copy_run(run, run.parent / snapshot_name(pending.pop(0)))
        time.sleep(args.poll)
    training.wait()  # exits with the log's tail if the pretraining failed
    for minutes in pending:
        print(f"no snapshot at {minutes:g} min: the pretraining ended first", flush=True)


def summarise(source: Path, finetuned: Path, flags: list[str]) -> dict:
    test, curve = test_metrics(finetuned), evaluations(finetuned)
    if test is None:
        raise SystemExit(f"{finetuned} has no test_metrics.json (the fine-tuning has not finished)")
    best = max(curve, key=lambda r: r["val_accuracy"])
    weights = min(evaluations(source), key=lambda r: r["val_loss"])  # the evaluation whose weights were fine-tuned
    return {"pretraining_minutes": round(weights["elapsed_s"] / 60, 1), "pretraining_steps": weights["step"],
            "mlm_val_loss": weights["val_loss"], "mlm_val_masked_accuracy": weights["val_accuracy"],
            "init_from": str(source), "run": str(finetuned), "test_accuracy": test["accuracy"],
            "test_loss": test["loss"], "best_val_accuracy": best["val_accuracy"], "best_step": best["step"],
            "finetune_steps": curve[-1]["step"], "finetune_minutes": round(curve[-1]["elapsed_s"] / 60, 1),
            "finetune_curve": [(r["step"], r["val_accuracy"]) for r in curve],
            "command": shown(train_command(finetuned, flags))}


def references(results: Path) -> dict:
    """Supervised-only (experiments.seeds) and TF-IDF (experiments.baseline) test accuracies, where recorded."""
    out = {}
    if (results / "seeds.json").exists():
        seeds = json.loads((results / "seeds.json").read_text())
        out["supervised_seeds"] = {**seeds["test_accuracy"], "time_budget": seeds["meta"]["time_budget"]}
    if (results / "baseline.json").exists():
        rows = json.loads((results / "baseline.json").read_text())["results"]
        out["tfidf"] = {name: row["test_accuracy"] for name, row in rows.items()}
    return out


def to_markdown(meta: dict, curve: list[dict], rows: list[dict], refs: dict) -> str:
    lines = [f"Command: `{meta['command']}` ({meta['date']}, {meta['threads']} thread(s) per process)", "",
             "Pretraining (validation: held-out unlabelled reviews, fixed masks):", "",
             "| step | epoch | minutes | val MLM loss | val masked-token accuracy | tokens/s |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['step']} | {r['epoch']} | {r['elapsed_s'] / 60:.1f} | {r['val_loss']:.3f} | "
              f"{r['val_accuracy']:.3f} | {r['tokens_per_s']:.0f} |" for r in curve]
    lines += ["", "Fine-tuned from each point (same recipe and budget):", "",
              "| pretraining min (steps) | MLM val loss | test accuracy | best val accuracy (step) | fine-tuning min (steps) |",
              "|---|---|---|---|---|"]
    lines += [f"| {r['pretraining_minutes']:g} ({r['pretraining_steps']}) | {r['mlm_val_loss']:.3f} | "
              f"{r['test_accuracy']:.4f} | {r['best_val_accuracy']:.4f} ({r['best_step']}) | "
              f"{r['finetune_minutes']} ({r['finetune_steps']}) |" for r in rows]
    if "supervised_seeds" in refs:
        s = refs["supervised_seeds"]
        lines += ["", f"Supervised only, from scratch, {s['time_budget']:g} min (experiments.seeds): test accuracy "
                      f"{s['mean']:.4f} ± {s['std']:.4f} over {s['n']} seeds."]
    for name, accuracy in refs.get("tfidf", {}).items():
        lines.append(f"TF-IDF + logistic regression ({name}): test accuracy {accuracy:.4f}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.pretraining", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.environ.get("CLASSIFY_DATA", "../shared/imdb"))
    p.add_argument("--pretrain-budget", type=float, default=95.0, help="minutes of pretraining")
    p.add_argument("--snapshots", type=float, nargs="*", default=[45.0],
                   help="also fine-tune the weights as they were after these minutes of pretraining")
    p.add_argument("--finetune-budget", type=float, default=30.0,
                   help="minutes of each fine-tuning (30: the supervised recipe's budget)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per process")
    p.add_argument("--parallel", type=int, default=2, help="fine-tunings at a time")
    p.add_argument("--runs", default="experiments/runs/pretraining", help="where the run folders go")
    add_results_args(p, "pretraining.json and .md")
    p.add_argument("--reuse", action="store_true",
                   help="keep what already exists in --runs: resume the pretraining (a finished one ends at once, "
                        "after tokenizing), keep its snapshots and the finished fine-tunings; without it "
                        "everything starts afresh")
    p.add_argument("--pretrain-args", default="", help="extra classify.pretrain flags (one quoted string)")
    p.add_argument("--finetune-args", default="", help="extra classify.train flags (one quoted string)")
    p.add_argument("--poll", type=float, default=10.0, help=argparse.SUPPRESS)  # seconds; tests shorten it
    args = p.parse_args(argv)
    if args.parallel < 1 or args.threads < 1:
        p.error("--parallel and --threads must be at least 1")

    runs = Path(args.runs)
    pretrained = runs / "pretrain"
    snapshots = [runs / snapshot_name(m) for m in sorted(args.snapshots)]

    def finetuned(source: Path) -> Path:
        return runs / f"finetune-{source.name}"

    if not args.reuse:  # start afresh: this experiment's earlier folders go
        for folder in (pretrained, *snapshots, *map(finetuned, [*snapshots, pretrained])):
            shutil.rmtree(folder, ignore_errors=True)
    if not (args.reuse and test_metrics(finetuned(pretrained)) is not None):  # else it finished long ago
        pretrain_with_snapshots(pretrained, args)
    sources = [*(s for s in snapshots if s.exists()), pretrained]

    def finetune_flags(source: Path) -> list[str]:
        return ["--data", args.data, "--init-from", str(source), "--time-budget", str(args.finetune_budget),
                "--threads", str(args.threads), "--quiet", *FINETUNE_RECIPE, *shlex.split(args.finetune_args)]

    todo = [s for s in sources if not (args.reuse and test_metrics(finetuned(s)) is not None)]
    for i in range(0, len(todo), args.parallel):
        wait_all([start_training(f"fine-tuning {s.name}", finetuned(s), finetune_flags(s), args.threads)
                  for s in todo[i:i + args.parallel]])

    rows = [summarise(s, finetuned(s), finetune_flags(s)) for s in sources]
    curve = evaluations(pretrained)
    refs = references(results_folder(args)) or references(RECORDED)
    meta = {**experiment_meta("experiments.pretraining", argv if argv is not None else sys.argv[1:]),
            "threads": args.threads, "pretrain_recipe": PRETRAIN_RECIPE, "finetune_recipe": FINETUNE_RECIPE,
            "pretrain_config": json.loads((pretrained / "config.json").read_text()),
            "median_pretrain_tokens_per_s": statistics.median(r["tokens_per_s"] for r in curve[1:]) if curve[1:] else None}
    write_results(results_folder(args), "pretraining", {"meta": meta, "pretraining_curve": curve, "finetuned": rows,
                                           "references": refs}, to_markdown(meta, curve, rows, refs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
