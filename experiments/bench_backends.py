"""Reviews/s and one-review latency of the inference backends: PyTorch eager (fp32, bf16 autocast) against ONNX
Runtime (the ``classify.export`` graph in fp32, and optionally its matrix products dynamically quantized to int8).

    python -m experiments.bench_backends --model runs/bench --sample 2000 --threads 1 2 --int8 --full-accuracy

Every arm runs the whole inference path (``inference.classify_texts``: prepare, run, answer) on the same raw test
reviews, in length-bucketed batches of 64; the arms take turns (``benchtools.interleave``), so load that comes
and goes on a shared machine costs them alike. Latency: the same reviews one at a time, each arm in turn per
review. ``--full-accuracy`` also scores fp32 and int8 on the whole test split (int8 is kept only if it wins).

Results: ``bench_backends.{json,md}`` in ``experiments/runs/results/`` (untracked), or with ``--record`` in
``experiments/results/``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from classify.backends import TorchBackend
from classify.engine.device import bf16_supported
from classify.engine.files import write_json, write_text
from classify.export import export, quantize_matmuls
from classify.inference import ONNX_MODEL, LoadedRun, classify_texts, load_export, load_run
from classify.text.data import load_split
from experiments import add_results_args, results_folder
from experiments.bench import default_data
from experiments.benchtools import interleave, load_average, machine_info, percentile, summarize

BATCH = 64


def quantize(export_folder: Path, out: Path) -> Path:
    """A copy of an export with its MatMul weights in int8, as ``classify.export --int8`` writes it."""
    shutil.copytree(export_folder, out, ignore=shutil.ignore_patterns(ONNX_MODEL))
    quantize_matmuls(export_folder / ONNX_MODEL, out / ONNX_MODEL)
    return out


def correct(run: LoadedRun, results: list, labels: list[int]) -> float:
    """The fraction of ``results`` (``TextResult``) whose label is the true one."""
    return float(np.mean([run.labels.index(r.label) == y for r, y in zip(results, labels)]))


def arms_at(threads: int, model: Path, export_folder: Path, int8: Path | None) -> dict[str, LoadedRun]:
    """Each backend with ``threads`` threads."""
    torch.set_num_threads(threads)
    cpu = torch.device("cpu")
    fp32 = load_run(model, cpu, None)
    arms = {"torch fp32": fp32}
    if bf16_supported(cpu):
        arms["torch bf16"] = LoadedRun(fp32.path, fp32.config, fp32.labels, fp32.preprocessing,
                                       TorchBackend(fp32.model, cpu, torch.bfloat16))
    arms["onnx fp32"] = load_export(export_folder, threads)
    if int8 is not None:
        arms["onnx int8"] = load_export(int8, threads)
    return arms


def measure(arms: dict[str, LoadedRun], texts: list[str], labels: list[int], repeats: int,
            latency_reviews: int) -> dict[str, Any]:
    """Throughput (reviews/s, interleaved rounds), accuracy on ``texts``, and one-review latency per arm."""
    for run in arms.values():          # warm-up: kernel choice, ONNX Runtime's first-run allocations
        classify_texts(run, texts[:BATCH], BATCH)
    answers: dict[str, list] = {}

    def classify(name: str) -> float:
        answers[name] = classify_texts(arms[name], texts, BATCH)
        return float(len(texts))

    samples = interleave({name: (lambda n=name: classify(n)) for name in arms}, repeats, torch.device("cpu"), warmup=0)
    out = {name: {**stats, "accuracy": correct(arms[name], answers[name], labels)}
           for name, stats in summarize(samples).items()}
    latencies: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    for i, text in enumerate(texts[:latency_reviews]):
        for name in names if i % 2 == 0 else reversed(names):
            start = time.perf_counter()
            classify_texts(arms[name], [text])
            latencies[name].append(time.perf_counter() - start)
    for name, values in latencies.items():
        out[name].update(latency_ms_p50=1e3 * percentile(values, 50), latency_ms_p95=1e3 * percentile(values, 95))
    return out


def to_markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [f"# Inference backends ({m['date_utc']} UTC)", "", f"Command: `{result['command']}`", "",
             f"Model: {result['model']} ({result['parameters']:,} parameters), exported to ONNX opset "
             f"{result['opset']}. CPU: {m['cpu_model']}, {m['logical_cpus']} logical CPUs, flags "
             f"{' '.join(m['cpu_flags'])}; torch {m['torch']}, onnxruntime {result['onnxruntime']}. "
             f"Load average before / after: {result['loadavg_before']} / {result['loadavg_after']} "
             f"(the 2 cores were shared with other work).", "",
             f"Throughput: {result['sample']} IMDB test reviews (a fixed seeded sample; raw text to labels, "
             f"length-bucketed batches of {BATCH}), median of {result['repeats']} interleaved rounds. Latency: "
             f"{result['latency_reviews']} of them one at a time (batch size 1).", "",
             "| threads | backend | reviews/s | vs torch fp32 | accuracy (sample) | batch-1 p50 ms | batch-1 p95 ms |",
             "|---|---|---|---|---|---|---|"]
    for threads, arms in result["threads"].items():
        base = arms["torch fp32"]["rate_median"]
        for name, a in arms.items():
            lines.append(f"| {threads} | {name} | {a['rate_median']:.1f} | {a['rate_median'] / base:.2f}x | "
                         f"{a['accuracy']:.4f} | {a['latency_ms_p50']:.1f} | {a['latency_ms_p95']:.1f} |")
    if result.get("full_accuracy"):
        lines += ["", f"Whole test split ({result['full_accuracy']['examples']:,} reviews): "
                  + ", ".join(f"{name} {acc:.4%}" for name, acc in result["full_accuracy"]["accuracy"].items())]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.bench_backends", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="a classifier run folder")
    p.add_argument("--export", type=Path, help="its classify.export folder (default: exported into a temporary one)")
    p.add_argument("--data", default=default_data(), help="IMDB source, as classify.train's --data")
    p.add_argument("--sample", type=int, default=2000, help="test reviews timed (0: the whole split)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts to measure at")
    p.add_argument("--repeats", type=int, default=2, help="interleaved timed rounds per thread count")
    p.add_argument("--latency-reviews", type=int, default=200, help="reviews timed one at a time")
    p.add_argument("--int8", action="store_true", help="also the export with int8 matrix products")
    p.add_argument("--full-accuracy", action="store_true",
                   help="also score the ONNX fp32 and int8 models on the whole test split")
    add_results_args(p, "bench_backends.json and .md")
    p.add_argument("--seed", type=int, default=0, help="seed of the sample")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("RAYON_NUM_THREADS", str(max(args.threads)))   # the tokenizer's pool, read once
    import onnxruntime

    test = load_split(args.data, "test")
    rows = np.random.default_rng(args.seed).permutation(len(test))[: args.sample or len(test)]
    texts, labels = [test.texts[i] for i in rows], [test.labels[i] for i in rows]
    command = "python -m experiments.bench_backends " + shlex.join(sys.argv[1:] if argv is None else argv)
    result: dict[str, Any] = {"command": command,
                              "machine": machine_info(torch.device("cpu")), "onnxruntime": onnxruntime.__version__,
                              "model": str(args.model), "sample": len(texts), "repeats": args.repeats,
                              "latency_reviews": args.latency_reviews, "loadavg_before": load_average(), "threads": {}}
    with tempfile.TemporaryDirectory(prefix="bench-backends-") as scratch:
        export_folder = args.export or Path(scratch) / "fp32"
        if args.export is None:
            export(args.model, export_folder)
        int8 = quantize(export_folder, Path(scratch) / "int8") if args.int8 else None
        for threads in args.threads:
            arms = arms_at(threads, args.model, export_folder, int8)
            result["parameters"] = arms["onnx fp32"].backend.parameters
            result["opset"] = arms["onnx fp32"].config["export"]["opset"]
            result["threads"][str(threads)] = measure(arms, texts, labels, args.repeats, args.latency_reviews)
            print(f"{threads} threads: " + ", ".join(f"{k} {v['rate_median']:.1f}/s" for k, v in
                                                       result["threads"][str(threads)].items()), flush=True)
        if args.full_accuracy:
            full = {name: run for name, run in arms.items() if name.startswith("onnx")}
            result["full_accuracy"] = {"examples": len(test),
                                       "accuracy": {name: correct(run, classify_texts(run, test.texts, BATCH),
                                                                  test.labels) for name, run in full.items()}}
    result["loadavg_after"] = load_average()
    stem = results_folder(args) / "bench_backends"
    stem.parent.mkdir(parents=True, exist_ok=True)
    write_json(stem.with_suffix(".json"), result)
    write_text(stem.with_suffix(".md"), to_markdown(result) + "\n")
    print(to_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
