"""Whether bf16 attention trains faster computed in fp32 on a CPU (twenty-seventh to twenty-ninth sessions, issue 23).

PyTorch's CPU flash-attention kernel in bf16 has a slow backward at short lengths. This times, paired and
interleaved (``benchtools.interleave``), two arms of the core's attention (``classify.core._sdpa``) under bf16
autocast: ``bf16`` (the bf16 kernel at every length) and ``fp32`` (queries, keys and values cast to fp32, the output
rounded back, at every length), in
  * one attention call, forward and backward, of random tensors (batch 32, the recipe's 4 heads of 32);
  * one training step (forward, backward, clipping, AdamW) of the recipe's transformer (no n-gram branch), with
    its initial weights and, with ``--run``, a trained run's weights: batches of 32 random token ids, a quarter
    of each batch's rows padded over their last eighth.
Denormal numbers are flushed to zero first (unless ``--keep-denormals``), as every command of the project does
(``engine.config.runtime``).
Result (experiments/RESULTS.md): the fp32 arm wins at short lengths; unflushed, with the weights of a run trained with
fp32 attention, it lost at 256 (denormals, which those weights make the fp32 softmax produce; twenty-eighth session,
``--keep-denormals``). The core computes training attention in fp32 up to
``classify.core.FP32_TRAINING_KEYS`` keys (twenty-ninth session).

    python -m experiments.attention_precision --run runs/imdb-v37-fp32attn-seed5 --threads 2 --record
"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

import classify.core as core
from classify.engine.optim import build_optimizer
from classify.inference import load_run
from classify.models import RECIPE, Classifier, ClassifierConfig

from . import add_results_args, results_folder
from .benchtools import cpu_model, interleave, paired_ratio, summarize
from .trainruns import experiment_meta, write_results

BATCH, HEADS, HEAD_DIM = 32, 4, 32


@contextmanager
def fp32_attention_up_to(keys: int):
    """The core computes bf16 attention that autograd records on a CPU in fp32 up to ``keys`` keys (0: never, as
    before the twenty-ninth session; ``ALWAYS``: at every length) inside the block; its own bound after it."""
    shipped = core.FP32_TRAINING_KEYS
    core.FP32_TRAINING_KEYS = keys
    try:
        yield
    finally:
        core.FP32_TRAINING_KEYS = shipped


ALWAYS = 1 << 30
ARMS = {"bf16": 0, "fp32": ALWAYS}  # arm -> the keys up to which attention runs in fp32


def _padded_tokens(length: int, vocab_size: int, pad_id: int, generator: torch.Generator) -> torch.Tensor:
    """(BATCH, length) random token ids, a quarter of the rows padded over their last eighth."""
    tokens = torch.randint(1, vocab_size, (BATCH, length), generator=generator)
    tokens[: BATCH // 4, length - length // 8:] = pad_id
    return tokens


def attention_arms(length: int, generator: torch.Generator) -> dict:
    """Forward and backward of one attention call, bf16 against fp32 with the casts; work = 1 call."""
    q, k, v = (torch.randn(BATCH, HEADS, length, HEAD_DIM, generator=generator).bfloat16().requires_grad_()
               for _ in range(3))
    mask = core.padding_mask(_padded_tokens(length, 2, 0, generator), 0)  # (BATCH, 1, 1, length)
    grad = torch.randn(BATCH, HEADS, length, HEAD_DIM, generator=generator).bfloat16()

    def arm(keys: int):
        def call() -> float:
            with fp32_attention_up_to(keys):
                core._sdpa(q, k, v, mask, 0.0).backward(grad)
            return 1.0
        return call
    return {name: arm(keys) for name, keys in ARMS.items()}


def step_arms(model: Classifier, length: int, generator: torch.Generator, arms: dict[str, int] = ARMS,
              optimizers: dict[str, torch.optim.Optimizer] | None = None) -> dict:
    """One training step of ``model`` under bf16 autocast per arm, with the core's attention in fp32 up to the arm's
    keys (``arms``: name -> keys) and the arm's optimizer (``optimizers``; default: the project's, one per arm, at a
    tiny rate so that the weights stay what they were); work = 1."""
    optimizers = optimizers or {name: build_optimizer(model, 1e-6, 0.01) for name in arms}
    tokens = _padded_tokens(length, model.config.vocab_size, model.config.pad_id, generator)
    targets = torch.rand(BATCH, model.config.num_classes, generator=generator).softmax(-1)

    def arm(keys: int, optimizer: torch.optim.Optimizer):
        def call() -> float:
            with fp32_attention_up_to(keys), torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(tokens, ngram=False)
            F.cross_entropy(logits.float(), targets).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return 1.0
        return call
    return {name: arm(keys, optimizers[name]) for name, keys in arms.items()}


def models_to_time(run: Path | None) -> dict[str, Classifier]:
    """The recipe's transformer (no n-gram branch) with its initial weights (seed 0) and, given ``run``, with that
    run's trained weights."""
    torch.manual_seed(0)
    alone = {**RECIPE, "ngram_orders": 0, "scope_embedding": False, "scope_dropout": 0.0}   # no branch, no scope
    models = {"initial weights": Classifier(ClassifierConfig(vocab_size=30_000, **alone))}
    if run:
        models[f"weights of {run.name}"] = load_run(run, torch.device("cpu")).model
    return models


def paired_times(arms: dict, repeats: int, base: str, other: str) -> tuple[float, float, float]:
    """Times two arms interleaved: (``base``'s median ms, ``other``'s, the paired speed-up of ``other``)."""
    samples = interleave(arms, repeats, torch.device("cpu"))
    times = summarize(samples)
    return (1000 * times[base]["seconds_median"], 1000 * times[other]["seconds_median"],
            paired_ratio(samples[other], samples[base]))


def timing_record(prog: str, argv: list[str], threads: int, rows: list[dict], **setup) -> dict:
    """What a timing experiment records: the command and machine, ``setup`` (its own settings), then ``rows``."""
    return {**experiment_meta(prog, argv), "cpu": cpu_model(), "threads": threads, "torch": torch.__version__,
            **setup, "rows": rows}


def write_table_report(args: argparse.Namespace, record: dict, title: str, setup: str, columns: list[str],
                       cells: list[list]) -> None:
    """Writes ``record`` and its markdown report (the title, the command and machine followed by ``setup``, a
    table of ``cells`` under ``columns``) where ``args`` say (--record, --name)."""
    report = "\n".join([
        f"# {title}", "",
        f"Command: `{record['command']}` ({record['date']}); {record['cpu']}, {record['threads']} threads, "
        f"bf16 {'on' if record['bf16'] else 'emulated'}, {setup}", "",
        "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
        *("| " + " | ".join(map(str, row)) + " |" for row in cells)]) + "\n"
    write_results(results_folder(args), args.name, record, report)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m experiments.attention_precision", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, help="a classifier run whose trained weights are timed too")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 64, 128, 256, 512])
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds per arm (ABBA order)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep-denormals", action="store_true",
                        help="do not flush denormal numbers to zero (classify's commands flush them)")
    parser.add_argument("--name", default="attention_precision", help="the report's file name")
    add_results_args(parser, "NAME.json and .md")
    args = parser.parse_args(argv)
    # Before the first parallel region: the thread pool inherits the main thread's floating-point state.
    torch.set_flush_denormal(not args.keep_denormals)
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    models = models_to_time(args.run)
    rows = []
    for length in args.lengths:
        cases = {"one attention call": attention_arms(length, generator)}
        cases.update({f"training step, {name}": step_arms(model.train(), length, generator)
                      for name, model in models.items()})
        for case, arms in cases.items():
            bf16_ms, fp32_ms, speedup = paired_times(arms, args.repeats, "bf16", "fp32")
            rows.append({"case": case, "length": length, "bf16_ms": bf16_ms, "fp32_ms": fp32_ms,
                         "fp32_speedup": speedup})
    record = timing_record("experiments.attention_precision", argv, args.threads, rows,
                           denormals="kept" if args.keep_denormals else "flushed to zero")
    write_table_report(
        args, record, "bf16 attention computed in bf16 or in fp32, CPU training",
        f"denormals {record['denormals']}, torch {record['torch']}. Batch {BATCH}, {HEADS} heads of {HEAD_DIM}; "
        f"medians of {args.repeats} interleaved rounds; speed-up: the paired median of bf16 time / fp32 time "
        f"(above 1: fp32 is faster).",
        ["case", "tokens", "bf16 (ms)", "fp32 with the casts (ms)", "fp32 speed-up"],
        [[r["case"], r["length"], f"{r['bf16_ms']:.1f}", f"{r['fp32_ms']:.1f}", f"{r['fp32_speedup']:.2f}x"]
         for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
