"""Load test of ``python -m classify.serve``: requests/s and latency with micro-batching on and off.

    python -m experiments.serve_load --model runs/imdb-default --threads 1 2 \\
        --requests 400 --clients 1 8 32 128 --output experiments/results/serve_load

For each server --threads and each mode (batching on: the server's defaults; off: --max-batch 1,
one request at a time) a real server is started on a free port of 127.0.0.1; then, for each number of concurrent
clients, that many async httpx clients send single real IMDB test reviews (a seeded sample) until
``--requests`` have been answered. Reported per level: requests/s, p50/p99 latency, failures (any
non-200 answer or transport error) and the server's mean batch size. Every loop is bounded; the
servers are stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from classify.cli import HelpFormatter

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "imdb" / "test.parquet"
MODES = {"on": [], "off": ["--max-batch", "1"]}
STARTUP_SECONDS = 120


@contextmanager
def serve_process(model: str | Path, *flags: str) -> Iterator[str]:
    """``python -m classify.serve`` on a free port of 127.0.0.1 (port 0; the server prints the address);
    yields its base URL and stops it (SIGINT, then SIGKILL) however the block ends. Its log goes to a
    file, not a pipe, so a chatty server can never block on a full pipe."""
    with tempfile.TemporaryFile("w+", encoding="utf-8") as log:
        process = subprocess.Popen([sys.executable, "-m", "classify.serve", "--model", str(model), "--port", "0",
                                    *flags], stdout=subprocess.DEVNULL, stderr=log)
        try:
            deadline = time.monotonic() + STARTUP_SECONDS
            while not (found := re.search(r"listening on (http://\S+)", _read(log))):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not start (exit status {process.poll()}):\n{_read(log)}")
                time.sleep(0.1)
            yield found.group(1)
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def _read(log) -> str:
    log.seek(0)
    return log.read()


def sample_reviews(path: Path, n: int, seed: int) -> list[str]:
    import pyarrow.parquet as pq

    texts = pq.read_table(path, columns=["text"]).column("text").to_pylist()
    rng = np.random.default_rng(seed)
    return [texts[i] for i in rng.choice(len(texts), size=n, replace=False)]


async def load_level(url: str, reviews: list[str], clients: int) -> dict:
    """``clients`` concurrent clients send one review per request until every review is answered."""
    import httpx

    queue = iter(reviews)   # shared: each client takes the next review (a bounded loop: len(reviews) requests)
    latencies: list[float] = []
    failures: list[str] = []

    async def client(http: httpx.AsyncClient) -> None:
        for text in queue:
            start = time.perf_counter()
            try:
                r = await http.post(f"{url}/v1/predict", json={"text": text})
                if r.status_code != 200:
                    failures.append(f"{r.status_code}: {r.text[:200]}")
            except httpx.HTTPError as err:
                failures.append(f"{type(err).__name__}: {err}")
            latencies.append(time.perf_counter() - start)

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(limits=limits, timeout=60) as http:
        before = (await http.get(f"{url}/v1/model")).json()["runtime"]["batches"]
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        seconds = time.perf_counter() - start
        after = (await http.get(f"{url}/v1/model")).json()["runtime"]["batches"]
    ms = np.array(latencies) * 1000
    batches = after["batches"] - before["batches"]
    return {"clients": clients, "requests": len(latencies), "failures": len(failures),
            "failure_examples": failures[:3], "seconds": round(seconds, 2),
            "requests_per_s": round(len(latencies) / seconds, 1),
            "p50_ms": round(float(np.percentile(ms, 50)), 1), "p99_ms": round(float(np.percentile(ms, 99)), 1),
            "mean_batch": round((after["texts"] - before["texts"]) / max(batches, 1), 1)}


def run_mode(args: argparse.Namespace, flags: list[str], reviews: list[str],
             warmup: list[str]) -> tuple[list[dict], dict]:
    """Every level against one server started with ``flags``; also what the server says of its model."""
    import httpx

    server_flags = [*flags, "--log-level", "warning"]
    with serve_process(args.model, *server_flags) as url:
        asyncio.run(load_level(url, warmup, 4))
        levels = []
        for clients in args.clients:
            levels.append(asyncio.run(load_level(url, reviews, clients)))
            print(json.dumps(levels[-1]), flush=True)
        return levels, httpx.get(f"{url}/v1/model", timeout=60).json()


def markdown(result: dict) -> str:
    lines = [f"# Serving load test ({result['date']})", "",
             f"Command: `{result['command']}`", "",
             f"Model: {result['model']['id']} ({result['model']['parameters']:,} parameters, "
             f"max_len {result['model']['sizes']['max_len']}); "
             f"{result['requests']} single real IMDB test reviews per level; CPU bf16: {result['cpu_bf16']}; "
             f"load average before/after: {result['load_before']} / {result['load_after']}.", "",
             "| server --threads | batching | clients | requests/s | p50 ms | p99 ms | failures | mean batch |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for threads, modes in result["runs"].items():
        for mode, levels in modes.items():
            lines += [f"| {threads} | {mode} | {lv['clients']} | {lv['requests_per_s']} | {lv['p50_ms']} | "
                      f"{lv['p99_ms']} | {lv['failures']} | {lv['mean_batch']} |" for lv in levels]
    lines.append("")
    for threads, modes in result["runs"].items():
        lines.append(f"Speed-up of batching at --threads {threads} (requests/s, on / off): " + ", ".join(
            f"{on['clients']} clients {on['requests_per_s'] / off['requests_per_s']:.2f}x"
            for on, off in zip(modes["on"], modes["off"])) + ".")
    return "\n".join(lines) + "\n"


def cpu_has_bf16() -> bool:
    try:
        return "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.serve_load", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, help="run folder to serve")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="parquet file with a 'text' column")
    p.add_argument("--requests", type=int, default=400, help="requests per level (each a distinct review)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32, 128], help="concurrency levels")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="the server's --threads, each in turn")
    p.add_argument("--seed", type=int, default=0, help="which reviews are sampled")
    p.add_argument("--output", type=Path, help="write OUTPUT.json and OUTPUT.md")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sample = sample_reviews(args.data, args.requests + 20, args.seed)
    reviews, warmup = sample[:args.requests], sample[args.requests:]
    load_before = [round(x, 2) for x in os.getloadavg()]
    runs: dict[str, dict[str, list[dict]]] = {}
    model: dict = {}
    for threads in args.threads:
        runs[str(threads)] = {}
        for mode, flags in MODES.items():
            print(f"--threads {threads}, batching {mode}", flush=True)
            runs[str(threads)][mode], model = run_mode(args, [*flags, "--threads", str(threads)], reviews, warmup)
    result = {"date": time.strftime("%Y-%m-%d %H:%M"),
              "command": "python -m experiments.serve_load " + " ".join(argv if argv is not None else sys.argv[1:]),
              "model": {k: model[k] for k in ("id", "parameters", "sizes")}, "server_limits": model["runtime"]["limits"],
              "requests": args.requests, "cpu_bf16": cpu_has_bf16(), "cpu_count": os.cpu_count(),
              "load_before": load_before, "load_after": [round(x, 2) for x in os.getloadavg()], "runs": runs}
    print(markdown(result))
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        args.output.with_suffix(".md").write_text(markdown(result), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
