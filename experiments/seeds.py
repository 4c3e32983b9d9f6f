"""The headline recipe over several seeds: how much of an accuracy is the recipe, how much the seed.

    python -m experiments.seeds --data ../shared/imdb                        # the recorded run: 3 seeds x 30 min
    python -m experiments.seeds --data ../shared/imdb --parallel 2           # two runs at a time, one thread each
    python -m experiments.seeds --data ../shared/imdb --runs runs --reuse    # tabulate runs that already finished

Each seed is one ``python -m classify.train`` run of the recipe below under ``--time-budget``
minutes; the seed changes the validation split carved from train, the initial weights and the
batch order. Every run ends with one evaluation of its best-validation weights on the test split.
Flags this script does not know go to ``classify.train`` unchanged (e.g. ``--limit 2000`` for a
quick look). Results: experiments/results/seeds.json and .md (per-seed rows, mean, standard
deviation and range, and the validation curves side by side).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from .trainruns import (evaluations, experiment_meta, shown, start_training, test_metrics, train_command, wait_all,
                        write_results)

RESULTS = Path(__file__).resolve().parent / "results"
# The recipe: the defaults of classify.train (n-gram branch, grouped validation); validation every 250 steps
# for the curve.
RECIPE = ["--eval-every", "250"]


def seed_flags(seed: int, args: argparse.Namespace, extra: list[str]) -> list[str]:
    return ["--data", args.data, "--seed", str(seed), "--time-budget", str(args.time_budget),
            "--threads", str(args.threads), "--quiet", *RECIPE, *extra]


def summarise(seed: int, run: Path, flags: list[str], wall: float | None) -> dict:
    records, test = evaluations(run), test_metrics(run)
    if test is None:
        raise SystemExit(f"seed {seed}: {run} has no test_metrics.json (the run has not finished)")
    best = max(records, key=lambda r: r["val_accuracy"])
    # With the n-gram branch, validation during training scores the transformer alone; the mixed model's
    # validation accuracy comes from the mix step. Either way, compare like with like: the gap is the
    # model's own validation accuracy minus its test accuracy.
    val = test.get("val_accuracy", {}).get("mixed", best["val_accuracy"])
    return {"seed": seed, "run": str(run), "test_accuracy": test["accuracy"], "test_loss": test["loss"],
            "val_accuracy": val, "val_test_gap": val - test["accuracy"],
            "components_test": test.get("components"), "components_val": test.get("val_accuracy"),
            "mix": test.get("mix"),
            "best_val_accuracy": best["val_accuracy"], "best_step": best["step"], "steps": records[-1]["step"],
            "train_minutes": round(records[-1]["elapsed_s"] / 60, 1),
            "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in records)),
            "wall_seconds": wall, "curve": [(r["step"], r["val_accuracy"]) for r in records],
            "command": shown(train_command(run, flags))}


def spread(values: list[float]) -> dict:
    """Mean, sample standard deviation (0 for one value) and range."""
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def to_markdown(meta: dict, rows: list[dict], test: dict, val: dict) -> str:
    lines = [f"Command: `{meta['command']}` ({meta['date']}, {meta['threads']} thread(s) per run, "
             f"{meta['parallel']} run(s) at a time, time budget {meta['time_budget']} min per seed)", "",
             "| seed | test accuracy | val accuracy (gap) | transformer alone test / val | n-grams alone test / val "
             "| mix | test loss | best transformer val (step) | steps | training min | tokens/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def alone(r: dict, part: str) -> str:
        return (f"{r['components_test'][part]:.4f} / {r['components_val'][part]:.4f}"
                if r.get("components_test") and r.get("components_val") else "")

    lines += [f"| {r['seed']} | {r['test_accuracy']:.4f} | {r['val_accuracy']:.4f} ({100 * r['val_test_gap']:+.2f}) "
              f"| {alone(r, 'transformer')} | {alone(r, 'ngram')} | {r.get('mix') or ''} | {r['test_loss']:.4f} "
              f"| {r['best_val_accuracy']:.4f} ({r['best_step']}) | {r['steps']} | {r['train_minutes']} "
              f"| {r['tokens_per_s']} |" for r in rows]
    lines += ["", f"Test accuracy over {test['n']} seeds: **{test['mean']:.4f} ± {test['std']:.4f}** (mean ± sample "
              f"std), range {test['min']:.4f}-{test['max']:.4f}. Validation accuracy: {val['mean']:.4f} ± "
              f"{val['std']:.4f} (gap {100 * (val['mean'] - test['mean']):+.2f} points).", "", "Validation accuracy by step:", "",
              "| step | " + " | ".join(f"seed {r['seed']}" for r in rows) + " |", "|---" * (len(rows) + 1) + "|"]
    curves = [dict(r["curve"]) for r in rows]
    for step in sorted({s for c in curves for s in c}):
        lines.append(f"| {step} | " + " | ".join(f"{c[step]:.4f}" if step in c else "" for c in curves) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.seeds", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.environ.get("CLASSIFY_DATA", "../shared/imdb"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--time-budget", type=float, default=30.0, help="training minutes per seed")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per run")
    p.add_argument("--parallel", type=int, default=1, help="runs at a time")
    p.add_argument("--runs", default="experiments/runs/seeds", help="where the run folders seed<N> go")
    p.add_argument("--reuse", action="store_true",
                   help="keep the seeds whose run already finished (has a test evaluation) and resume unfinished "
                        "ones; without it every seed trains afresh, replacing its run folder")
    p.add_argument("--results", type=Path, default=RESULTS, help="where seeds.json and seeds.md go")
    args, extra = p.parse_known_args(argv)
    if args.parallel < 1 or args.threads < 1:
        p.error("--parallel and --threads must be at least 1")
    if len(set(args.seeds)) < len(args.seeds):
        p.error(f"--seeds has repeats: {args.seeds}")

    runs = {seed: Path(args.runs) / f"seed{seed}" for seed in args.seeds}
    todo = [s for s in args.seeds if not (args.reuse and test_metrics(runs[s]) is not None)]
    walls: dict[int, float | None] = dict.fromkeys(args.seeds)
    fresh = [] if args.reuse else ["--overwrite"]
    for i in range(0, len(todo), args.parallel):
        group = todo[i:i + args.parallel]
        seconds = wait_all([start_training(f"seed {s}", runs[s], seed_flags(s, args, extra) + fresh, args.threads)
                            for s in group])
        for seed, wall in zip(group, seconds):
            walls[seed] = wall
            print(f"seed {seed}: done in {wall / 60:.1f} min", flush=True)

    rows = [summarise(s, runs[s], seed_flags(s, args, extra), walls[s]) for s in args.seeds]
    test = spread([r["test_accuracy"] for r in rows])
    val = spread([r["val_accuracy"] for r in rows])
    meta = {**experiment_meta("experiments.seeds", argv if argv is not None else sys.argv[1:]),
            "threads": args.threads, "parallel": args.parallel, "time_budget": args.time_budget}
    write_results(args.results, "seeds", {"meta": meta, "test_accuracy": test, "best_val_accuracy": val,
                                                "rows": rows}, to_markdown(meta, rows, test, val))
    return 0


if __name__ == "__main__":
    sys.exit(main())
