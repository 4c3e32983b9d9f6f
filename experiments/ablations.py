"""From Bloem's configuration to ours, one change at a time (issue: accuracy experiments).

    python -m experiments.ablations --data ../shared/imdb            # the recorded run
    python -m experiments.ablations --data ../shared/imdb --only bloem ours

Each variant is a ``python -m classify.train`` run on the same split (validation carved from
train with the same seed), the same number of optimizer steps and the same learning-rate
schedule; the table reports the best validation accuracy (the test split is kept for the
headline numbers), wall time and real-token throughput. It is a *reduced-scale* protocol
(default 300 steps of 32 reviews, max length 256) so that all variants fit a 2-core CPU in
well under an hour: read it for the direction and size of each change, not for final accuracy.
Results: experiments/results/ablations.json and .md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from . import add_results_args, results_folder
from .trainruns import evaluations, experiment_meta, run_training, shown, train_command, write_results

# Bloem's "Transformers from scratch" classifier: 6 blocks, 128 wide, 8 heads, vocabulary 50k,
# mean pooling over everything (no padding mask), post-LN, fp32, batches padded to the maximum length.
BLOEM = ["--layers", "6", "--d-model", "128", "--heads", "8", "--d-ff", "512", "--vocab-size", "50000",
         "--tokenizer", "word", "--pooling", "mean", "--positional", "learned", "--no-padding-mask", "--post-ln",
         "--precision", "fp32", "--batching", "fixed", "--truncation", "head"]


def replace(args: list[str], flag: str, value: str | None = None) -> list[str]:
    """Copy of ``args`` with ``flag`` removed (and re-added with ``value`` unless None)."""
    out, skip = [], False
    for i, a in enumerate(args):
        if skip:
            skip = False
            continue
        if a == flag:
            skip = i + 1 < len(args) and not args[i + 1].startswith("--")
            continue
        out.append(a)
    if value is not None:
        out += [flag] if value == "" else [flag, value]
    return out


def variants() -> list[tuple[str, str, list[str]]]:
    """(name, what changed, train flags): a cumulative chain from Bloem's setup to ours."""
    chain = [("bloem", "Bloem's configuration through our code", BLOEM)]
    steps = [
        ("+padding-mask", "attention and pooling ignore padding", lambda a: replace(a, "--no-padding-mask")),
        ("+pre-ln", "pre-LayerNorm blocks + final LayerNorm", lambda a: replace(a, "--post-ln")),
        ("+bucketing", "length-bucketed batches instead of padding to max length",
         lambda a: replace(a, "--batching", "bucket")),
        # auto, not bf16: where the CPU has no bf16 this step changes nothing (recorded as meta["bf16"]).
        ("+autocast", "bf16 autocast where the machine has it (--precision auto)",
         lambda a: replace(a, "--precision", "auto")),
        ("+head+tail", "keep first quarter + last three quarters of long reviews",
         lambda a: replace(a, "--truncation", "head+tail")),
    ]
    for name, what, change in steps:
        chain.append((name, what, change(chain[-1][2])))
    last = chain[-1][2]
    chain.append(("bpe-30k", "BPE 30k tokenizer instead of word-level 50k (vs. +head+tail)",
                  replace(replace(last, "--tokenizer", "bpe"), "--vocab-size", "30000")))
    chain.append(("ours", "our default recipe: 2 blocks, 4 heads, word-level 30k (vs. +head+tail)",
                  replace(replace(replace(last, "--layers", "2"), "--heads", "4"), "--vocab-size", "30000")))
    return chain


def run_variant(name: str, variant_flags: list[str], args: argparse.Namespace) -> dict:
    out = Path(args.runs) / name.replace("+", "plus-")
    flags = ["--data", args.data, "--overwrite", "--max-steps", str(args.steps), "--eval-every", str(args.eval_every),
             "--max-len", str(args.max_len), "--batch-size", "32", "--val-size", str(args.val_size),
             "--lr", str(args.lr), "--warmup", "100", "--seed", str(args.seed), "--threads", str(args.threads),
             "--no-test", "--quiet", *variant_flags]
    records = evaluations(out)
    finished = bool(records) and records[-1]["step"] == args.steps
    wall = None if args.reuse and finished else run_training(name, out, flags, args.threads)
    records = evaluations(out)
    best = max(records, key=lambda r: r["val_accuracy"])
    return {"name": name, "flags": variant_flags, "best_val_accuracy": best["val_accuracy"], "best_step": best["step"],
            "final_val_accuracy": records[-1]["val_accuracy"], "train_seconds": records[-1]["elapsed_s"],
            "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in records)),
            "wall_seconds": wall, "curve": [(r["step"], r["val_accuracy"]) for r in records],
            "command": shown(train_command(out, flags))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.ablations", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.environ.get("CLASSIFY_DATA", "../shared/imdb"))
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per variant")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=5e-4, help="one learning rate for every variant")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val-size", type=int, default=2500, help="validation reviews carved from train")
    p.add_argument("--threads", type=int, default=1, help="OMP threads per training run")
    p.add_argument("--runs", default="experiments/runs/ablations", help="where the run folders go (git-ignored)")
    p.add_argument("--only", nargs="*", help="run only these variants")
    add_results_args(p, "ablations.json and .md")
    p.add_argument("--reuse", action="store_true",
                   help="take variants whose run folder already finished --steps from that folder (lets the "
                        "chain run in pieces, e.g. in parallel with --only, then be tabulated at once)")
    args = p.parse_args(argv)

    chosen = [v for v in variants() if not args.only or v[0] in args.only]
    rows = []
    for name, what, flags in chosen:
        print(f"== {name}: {what}", flush=True)
        row = run_variant(name, flags, args)
        row["change"] = what
        rows.append(row)
        print(f"   best val acc {row['best_val_accuracy']:.4f} at step {row['best_step']}, "
              f"{row['train_seconds']:.0f}s training", flush=True)
    meta = {**experiment_meta("experiments.ablations", argv if argv is not None else sys.argv[1:]),
            "threads": args.threads, "steps": args.steps, "max_len": args.max_len, "lr": args.lr}
    lines = [f"Command: `{meta['command']}` ({meta['date']}, {meta['threads']} thread(s), "
             f"{args.steps} steps x 32 reviews, max length {args.max_len}, lr {args.lr})", "",
             "| variant | change | best val acc | training s (incl. validation) | real tokens/s |", "|---|---|---|---|---|"]
    lines += [f"| {r['name']} | {r['change']} | {r['best_val_accuracy']:.4f} | {r['train_seconds']:.0f} | {r['tokens_per_s']} |" for r in rows]
    write_results(results_folder(args), "ablations", {"meta": meta, "rows": rows}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
