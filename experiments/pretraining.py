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
import subprocess
import sys
import time
from pathlib import Path

from .trainruns import evaluations, experiment_meta, start_training, test_metrics, write_results

RESULTS = Path(__file__).resolve().parent / "results"
# Pretraining: no dropout (the model is far from overfitting 18M tokens) and 2k-token batches; both measured
# faster per MLM-loss point on this CPU than the defaults (experiments/RESULTS_pretrain.md).
PRETRAIN_RECIPE = ["--dropout", "0", "--max-tokens", "2048", "--warmup", "300", "--epochs", "4",
                   "--eval-every", "500", "--save-every", "200"]
# Fine-tuning: between from-scratch (1e-3) and the BERT-style default (3e-4), short warmup for a short budget.
FINETUNE_RECIPE = ["--lr", "5e-4", "--warmup", "100", "--attention-dropout", "0", "--eval-every", "150"]
# What a fine-tuning run needs from a pretraining run (last/, the resume state, is not).
RUN_FILES = ("config.json", "tokenizer.json", "model.safetensors", "metrics.jsonl")


def snapshot_name(minutes: float) -> str:
    return f"pretrain-at-{minutes:g}min"


def start_pretraining(run: Path, args: argparse.Namespace) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
           "RAYON_NUM_THREADS": str(args.threads)}
    command = [sys.executable, "-m", "classify.pretrain", "--data", args.data, "--output", str(run),
               "--time-budget", str(args.pretrain_budget), "--threads", str(args.threads), "--quiet",
               *PRETRAIN_RECIPE, *shlex.split(args.pretrain_args)]
    run.parent.mkdir(parents=True, exist_ok=True)
    with open(run.with_suffix(".log"), "w") as log:
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)


def copy_run(run: Path, to: Path) -> None:
    """A fine-tunable copy of ``run`` as it is now (its files are replaced atomically, so each copy is whole)."""
    to.mkdir(parents=True, exist_ok=True)
    for name in RUN_FILES:
        shutil.copy2(run / name, to / name)


def pretrain_with_snapshots(run: Path, args: argparse.Namespace) -> None:
    """Run the pretraining; copy it to ``snapshot_name(m)`` at its first evaluation after ``m`` minutes."""
    process = start_pretraining(run, args)
    pending = sorted(m for m in args.snapshots if not (run.parent / snapshot_name(m)).exists())
    while process.poll() is None:
        records = evaluations(run)
        if pending and records and records[-1]["elapsed_s"] / 60 >= pending[0]:
            time.sleep(args.poll)  # an evaluation's weights are saved just after its record is written
            copy_run(run, run.parent / snapshot_name(pending.pop(0)))
        else:
            time.sleep(args.poll)
    if process.returncode != 0:
        raise SystemExit(f"pretraining failed (exit {process.returncode}); see {run.with_suffix('.log')}")
    for minutes in pending:
        print(f"no snapshot at {minutes:g} min: the pretraining ended first", flush=True)


def summarise(source: Path, finetuned: Path, flags: list[str]) -> dict:
    test, curve, mlm = test_metrics(finetuned), evaluations(finetuned), evaluations(source)
    if test is None:
        raise SystemExit(f"{finetuned} has no test_metrics.json (the fine-tuning has not finished)")
    best = max(curve, key=lambda r: r["val_accuracy"])
    return {"pretraining_minutes": round(mlm[-1]["elapsed_s"] / 60, 1), "pretraining_steps": mlm[-1]["step"],
            "mlm_val_loss": mlm[-1]["val_loss"], "mlm_val_masked_accuracy": mlm[-1]["val_accuracy"],
            "init_from": str(source), "run": str(finetuned), "test_accuracy": test["accuracy"],
            "test_loss": test["loss"], "best_val_accuracy": best["val_accuracy"], "best_step": best["step"],
            "finetune_steps": curve[-1]["step"], "finetune_minutes": round(curve[-1]["elapsed_s"] / 60, 1),
            "finetune_curve": [(r["step"], r["val_accuracy"]) for r in curve],
            "command": " ".join(["python -m classify.train", *flags])}


def references(results: Path) -> dict:
    """Supervised-only (experiments.seeds) and TF-IDF (experiments.baseline) test accuracies, where recorded."""
    out = {}
    if (results / "seeds.json").exists():
        seeds = json.loads((results / "seeds.json").read_text())
        out["supervised_30min_seeds"] = seeds["test_accuracy"]
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
    if "supervised_30min_seeds" in refs:
        s = refs["supervised_30min_seeds"]
        lines += ["", f"Supervised only, from scratch (experiments.seeds): test accuracy {s['mean']:.4f} ± "
                      f"{s['std']:.4f} over {s['n']} seeds."]
    for name, accuracy in refs.get("tfidf", {}).items():
        lines.append(f"TF-IDF + logistic regression ({name}): test accuracy {accuracy:.4f}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.pretraining", description=__doc__,
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
    p.add_argument("--results", default=str(RESULTS), help="where pretraining.json and .md go")
    p.add_argument("--reuse", action="store_true",
                   help="keep a pretraining run, snapshots and fine-tunings that already exist in --runs")
    p.add_argument("--pretrain-args", default="", help="extra classify.pretrain flags (one quoted string)")
    p.add_argument("--finetune-args", default="", help="extra classify.train flags (one quoted string)")
    p.add_argument("--poll", type=float, default=10.0, help=argparse.SUPPRESS)  # seconds; tests shorten it
    args = p.parse_args(argv)

    runs = Path(args.runs)
    pretrained = runs / "pretrain"
    if not (args.reuse and (pretrained / "model.safetensors").exists()):
        pretrain_with_snapshots(pretrained, args)
    sources = [runs / snapshot_name(m) for m in sorted(args.snapshots) if (runs / snapshot_name(m)).exists()]
    sources.append(pretrained)

    def finetune_flags(source: Path) -> list[str]:
        return ["--data", args.data, "--init-from", str(source), "--time-budget", str(args.finetune_budget),
                "--quiet", *FINETUNE_RECIPE, *shlex.split(args.finetune_args)]

    def finetuned(source: Path) -> Path:
        return runs / f"finetune-{source.name}"

    todo = [s for s in sources if not (args.reuse and test_metrics(finetuned(s)) is not None)]
    for i in range(0, len(todo), args.parallel):
        group = [start_training(f"fine-tuning {s.name}", finetuned(s), finetune_flags(s), args.threads)
                 for s in todo[i:i + args.parallel]]
        for training in group:
            training.wait()

    rows = [summarise(s, finetuned(s), ["--output", str(finetuned(s)), *finetune_flags(s)]) for s in sources]
    curve = evaluations(pretrained)
    results = Path(args.results)
    refs = references(results)
    meta = {**experiment_meta("experiments.pretraining", argv if argv is not None else sys.argv[1:]),
            "threads": args.threads, "pretrain_recipe": PRETRAIN_RECIPE, "finetune_recipe": FINETUNE_RECIPE,
            "pretrain_config": json.loads((pretrained / "config.json").read_text()),
            "median_pretrain_tokens_per_s": statistics.median(r["tokens_per_s"] for r in curve[1:]) if curve[1:] else None}
    write_results(results, "pretraining", {"meta": meta, "pretraining_curve": curve, "finetuned": rows,
                                           "references": refs}, to_markdown(meta, curve, rows, refs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
