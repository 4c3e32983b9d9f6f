"""Load test of ``python -m classify.serve``: requests/s and latency with micro-batching on and off.

    python -m experiments.serve_load --model runs/imdb-default --threads 1 2 \\
        --requests 200 --rounds 3 --clients 1 8 32 128 --output experiments/results/serve_load

For each server --threads, three real servers run at once on free ports of 127.0.0.1: batching on (the
server's defaults), on with --max-delay-ms 0 (no wait for company), and off (--max-batch 1, one request
at a time). For each number of concurrent clients, that many async aiohttp clients send single real IMDB
test reviews (a seeded sample, the same for all) until ``--requests`` (at least 3 per client) are
answered, in ``--rounds`` rounds that alternate between the servers, so that a shared machine's
changing load falls on all alike. Reported per level: requests/s, p50/p99 latency, failures (any non-200 answer or transport error) and the mean
number of texts per worker batch, and the load generator's own CPU per request (it shares the
machine with the servers); and, as a reference, the model's arithmetic alone in milliseconds
per review, one at a time and batched. Every loop is bounded; the servers are stopped at the end.
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
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np

from classify.engine.config import HelpFormatter

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "imdb" / "test.parquet"
# Batching on (the server's defaults), on without the wait for company (a batch is whatever queued while the
# previous one ran), and off (one request at a time).
MODES = {"on": [], "on-nowait": ["--max-delay-ms", "0"], "off": ["--max-batch", "1"]}
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


async def load_round(url: str, reviews: list[str], clients: int) -> dict:
    """``clients`` concurrent clients send one review per request until every review is answered:
    the latencies (s), the failures, the wall time, the load generator's own CPU time, and the texts
    and batches the server ran meanwhile.

    The clients are aiohttp's: on two CPUs the load generator shares the machine with the server, and
    httpx's async client spent about 20 ms of CPU per request at 128 clients (a whole core), so the
    test measured the client rather than the server."""
    import aiohttp

    queue = iter(reviews)   # shared: each client takes the next review (a bounded loop: len(reviews) requests)
    latencies: list[float] = []
    failures: list[str] = []

    async def client(http: aiohttp.ClientSession) -> None:
        for text in queue:
            start = time.perf_counter()
            try:
                async with http.post(f"{url}/v1/predict", json={"text": text}) as r:
                    body = await r.read()
                    if r.status != 200:
                        failures.append(f"{r.status}: {body[:200].decode(errors='replace')}")
            except (aiohttp.ClientError, asyncio.TimeoutError) as err:
                failures.append(f"{type(err).__name__}: {err}")
            latencies.append(time.perf_counter() - start)

    async def batches(http: aiohttp.ClientSession) -> dict:
        async with http.get(f"{url}/v1/model") as r:
            return (await r.json())["runtime"]["batches"]

    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as http:
        before = await batches(http)
        start, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        after = await batches(http)
    return {"latencies": latencies, "failures": failures, "seconds": seconds, "client_cpu": cpu,
            "texts": after["texts"] - before["texts"], "batches": after["batches"] - before["batches"]}


def summary(clients: int, rounds: list[dict]) -> dict:
    ms = np.array([x for r in rounds for x in r["latencies"]]) * 1000
    failures = [f for r in rounds for f in r["failures"]]
    seconds = sum(r["seconds"] for r in rounds)
    return {"clients": clients, "requests": len(ms), "rounds": len(rounds), "failures": len(failures),
            "failure_examples": failures[:3], "seconds": round(seconds, 2),
            "requests_per_s": round(len(ms) / seconds, 1),
            "p50_ms": round(float(np.percentile(ms, 50)), 1), "p99_ms": round(float(np.percentile(ms, 99)), 1),
            "client_cpu_ms": round(sum(r["client_cpu"] for r in rounds) / len(ms) * 1000, 2),
            "mean_batch": round(sum(r["texts"] for r in rounds) / max(sum(r["batches"] for r in rounds), 1), 1)}


def run_threads(args: argparse.Namespace, threads: int, reviews: list[str]) -> tuple[dict[str, list[dict]], dict]:
    """Every mode's server at once, and every level in ``args.rounds`` rounds that alternate
    between them, so that a change in the machine's other load meanwhile falls on both alike (the idle
    server waits on a queue and costs nothing). Also what the server says of its model."""
    with ExitStack() as stack:
        urls = {mode: stack.enter_context(serve_process(args.model, *flags, "--threads", str(threads),
                                                        "--log-level", "warning"))
                for mode, flags in MODES.items()}
        for url in urls.values():
            asyncio.run(load_round(url, reviews[:20], 4))   # warm up
        levels: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for clients in args.clients:
            # At least 3 requests per client, or the highest concurrency is never reached for long.
            n = max(args.requests, 3 * clients)
            rounds: dict[str, list[dict]] = {mode: [] for mode in MODES}
            for _ in range(args.rounds):
                for mode, url in urls.items():
                    rounds[mode].append(asyncio.run(load_round(url, reviews[:n], clients)))
            for mode in MODES:
                levels[mode].append(summary(clients, rounds[mode]))
                print(f"--threads {threads}, batching {mode}: {json.dumps(levels[mode][-1])}", flush=True)
        with urllib.request.urlopen(f"{urls['on']}/v1/model", timeout=60) as answer:
            return levels, json.load(answer)


def compute_reference(model: str, reviews: list[str], threads: int, limits: dict) -> dict:
    """The model's arithmetic alone, in this process (no HTTP): ms per review through
    ``inference.classify_texts`` one review at a time, and all together as the server batches them
    (best of 3). The ceiling of what batching can buy on this CPU."""
    import torch

    from classify.inference import classify_texts, load_run

    torch.set_num_threads(threads)
    run = load_run(model, torch.device("cpu"))

    def best_ms(fn) -> float:
        times = []
        for _ in range(4):   # the first is a warm-up
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return round(min(times[1:]) / len(reviews) * 1000, 2)

    return {"threads": threads, "reviews": len(reviews),
            "one_at_a_time_ms": best_ms(lambda: [classify_texts(run, [t], 1) for t in reviews]),
            "batched_ms": best_ms(lambda: classify_texts(run, reviews, limits["max_batch"],
                                                         max_tokens=limits["max_batch_tokens"]))}


def markdown(result: dict) -> str:
    lines = [f"# Serving load test ({result['date']})", "",
             f"Command: `{result['command']}`", "",
             f"Model: {result['model']['id']} ({result['model']['parameters']:,} parameters, "
             f"max_len {result['model']['sizes']['max_len']}); "
             f"at least {result['requests']} single real IMDB test reviews per level and round, "
             f"{result['rounds']} rounds alternating between the servers; server limits {result['server_limits']}; "
             f"{result['cpu_count']} CPUs, bf16: {result['cpu_bf16']}; "
             f"load average before/after: {result['load_before']} / {result['load_after']}.", "",
             "| server --threads | batching | clients | requests/s | p50 ms | p99 ms | failures | mean batch "
             "| client CPU ms/request |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for threads, modes in result["runs"].items():
        for mode, levels in modes.items():
            lines += [f"| {threads} | {mode} | {lv['clients']} | {lv['requests_per_s']} | {lv['p50_ms']} | "
                      f"{lv['p99_ms']} | {lv['failures']} | {lv['mean_batch']} | {lv['client_cpu_ms']} |"
                      for lv in levels]
    lines.append("")
    for threads, modes in result["runs"].items():
        for mode in (m for m in modes if m != "off"):
            lines.append(f"Speed-up of batching {mode} at --threads {threads} (requests/s, {mode} / off): " + ", ".join(
                f"{on['clients']} clients {on['requests_per_s'] / off['requests_per_s']:.2f}x"
                for on, off in zip(modes[mode], modes["off"])) + ".")
    lines += ["", "The model's arithmetic alone (no HTTP), ms per review, best of 3: "
              + "; ".join(f"--threads {r['threads']}: {r['one_at_a_time_ms']} one at a time, {r['batched_ms']} batched"
                          for r in result["compute_reference"]) + "."]
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
    p.add_argument("--requests", type=int, default=200,
                   help="requests per level and round (each a distinct review; at least 3 per client)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per level, alternating batching on and off")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32, 128], help="concurrency levels")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="the server's --threads, each in turn")
    p.add_argument("--seed", type=int, default=0, help="which reviews are sampled")
    p.add_argument("--output", type=Path, help="write OUTPUT.json and OUTPUT.md")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    reviews = sample_reviews(args.data, max(args.requests, 3 * max(args.clients)), args.seed)
    load_before = [round(x, 2) for x in os.getloadavg()]
    runs: dict[str, dict[str, list[dict]]] = {}
    model: dict = {}
    for threads in args.threads:
        runs[str(threads)], model = run_threads(args, threads, reviews)
    reference = [compute_reference(args.model, reviews[:64], threads, model["runtime"]["limits"])
                 for threads in args.threads]
    result = {"date": time.strftime("%Y-%m-%d %H:%M"),
              "command": "python -m experiments.serve_load " + " ".join(argv if argv is not None else sys.argv[1:]),
              "model": {k: model[k] for k in ("id", "parameters", "sizes")}, "server_limits": model["runtime"]["limits"],
              "requests": args.requests, "rounds": args.rounds, "cpu_bf16": cpu_has_bf16(), "cpu_count": os.cpu_count(),
              "load_before": load_before, "load_after": [round(x, 2) for x in os.getloadavg()], "runs": runs,
              "compute_reference": reference}
    print(markdown(result))
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        args.output.with_suffix(".md").write_text(markdown(result), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
