"""A training step on the CPU before and after the twenty-ninth session's changes (issue 23).

Two arms, timed paired and interleaved (``benchtools.interleave``) on one training step (forward, backward,
clipping, AdamW) of the recipe's transformer (no n-gram branch) under bf16 autocast, batches of 32 random token ids
(``experiments.attention_precision``'s: a quarter of the rows padded over their last eighth), with its initial
weights and, with ``--run``, a trained run's weights:
  * ``before``: AdamW's foreach kernel and PyTorch's bf16 attention kernel at every length (the code until the
    twenty-eighth session);
  * ``now``: the project's optimizer (AdamW's fused kernel) and the core's attention (fp32 up to
    ``classify.core.FP32_TRAINING_KEYS`` keys, bf16 beyond).
Denormal numbers are flushed in both arms, as every command of the project does (it cannot differ between arms of
one process: the thread pool keeps the state it started with).

    python -m experiments.step_speed --run runs/imdb-v37-base-seed5 --threads 2 --record
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import classify.core as core
from classify.engine.optim import build_optimizer
from classify.models import Classifier

from . import add_results_args
from .attention_precision import models_to_time, paired_times, step_arms, timing_record, write_table_report


def optimizers(model: Classifier) -> dict[str, torch.optim.Optimizer]:
    """Each arm's optimizer: the same groups and settings, foreach for ``before`` and the project's for ``now``."""
    now = build_optimizer(model, 1e-6, 0.01)  # a tiny rate: the weights stay what they were
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in now.param_groups]
    return {"before": torch.optim.AdamW(groups, lr=1e-6, betas=now.defaults["betas"], foreach=True),
            "now": now}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m experiments.step_speed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, help="a classifier run whose trained weights are timed too")
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512])
    parser.add_argument("--repeats", type=int, default=9, help="timed rounds per arm (ABBA order)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--name", default="step_speed", help="the report's file name")
    add_results_args(parser, "NAME.json and .md")
    args = parser.parse_args(argv)
    torch.set_flush_denormal(True)  # before the first parallel region: the thread pool inherits it
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    models = models_to_time(args.run)
    arms = {"before": 0, "now": core.FP32_TRAINING_KEYS}
    rows = []
    for length in args.lengths:
        for name, model in models.items():
            steps = step_arms(model.train(), length, generator, arms, optimizers(model))
            before_ms, now_ms, speedup = paired_times(steps, args.repeats, "before", "now")
            rows.append({"weights": name, "length": length, "before_ms": before_ms, "now_ms": now_ms,
                         "speedup": speedup})
    record = timing_record("experiments.step_speed", argv, args.threads, rows,
                           fp32_training_keys=core.FP32_TRAINING_KEYS)
    write_table_report(
        args, record, "A CPU training step before and after the twenty-ninth session",
        f"denormals flushed, torch {record['torch']}. One training step of the recipe's transformer, batch 32; "
        f"before: foreach AdamW, bf16 attention; now: fused AdamW, fp32 attention up to {core.FP32_TRAINING_KEYS} "
        f"keys. Medians of {args.repeats} interleaved rounds; speed-up: the paired median of before / now.",
        ["weights", "tokens", "before (ms)", "now (ms)", "speed-up"],
        [[r["weights"], r["length"], f"{r['before_ms']:.1f}", f"{r['now_ms']:.1f}", f"{r['speedup']:.2f}x"]
         for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
