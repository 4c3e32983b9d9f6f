"""Load test of ``python -m classify.serve``: requests/s and latency with micro-batching on and off.

    python -m experiments.serve_load --model runs/imdb-default --threads 1 2 \\
        --requests 200 --rounds 3 --clients 1 8 32 128 --output experiments/results/serve_load

For each server --threads, three real servers run at once on free ports of 127.0.0.1: batching on (the
server's defaults), on with --max-delay-ms 0 (no wait for company), and off (--max-batch 1, one request
at a time). For each number of concurrent clients, that many async aiohttp clients send single real IMDB
test reviews (a seeded sample, the same for all) until ``--requests`` (at least 3 per client) are
answered, in ``--rounds`` rounds that alternate between the servers, so that a shared machine's
changing load falls on all alike. Reported per level: requests/s, p50/p99 latency, failures (any non-200
answer or transport error, counted by status or error) and the mean number of texts per worker batch, and
the load generator's own CPU per request (it shares the machine with the servers); and, as a reference,
the model's arithmetic alone in milliseconds per review, one at a time and batched. Every loop is bounded;
the servers are stopped at the end.

With ``--open-loop 0.5 0.8 0.95`` it runs the open-loop test instead, as real users load a server: one
server (batching on) per --threads; its capacity is measured closed-loop (--capacity-clients clients,
--rounds rounds of --requests); then requests arrive at those fractions of capacity, Poisson-spaced and
independent of the answers, for --seconds each. Latency counts from when a request was due, so a load
generator that falls behind cannot hide queueing. The serving efficiency is the capacity over what the
model alone (no HTTP, the server's threads and precision, this process's environment) does on the batch sizes
the server ran at capacity. The server lets PyTorch's idle threads sleep (OMP_WAIT_POLICY=PASSIVE), which costs
the model itself time on some machines; when its policy differs from this process's, the model alone is also
run with the server's, and the efficiency against that tells the loss to HTTP apart from the threads' waking up:

    python -m experiments.serve_load --model runs/small --threads 2 --open-loop 0.5 0.8 0.95 \\
        --capacity-clients 32 --seconds 20 --output experiments/results/serve_open_loop

``--max-delay-ms 5 0`` and ``--workers 1 2`` run the open-loop test once per server window and number of worker
processes (and --threads), each in turn, so that serving layouts are compared on the same machine in the same run.
With several workers the batch counts are summed over the processes, and the model-alone reference runs as many
processes at once, each on its share of the batches.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import NamedTuple

import numpy as np

from classify.engine.config import HelpFormatter

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "imdb" / "test.parquet"
# Batching on (the server's defaults), on without the wait for company (a batch is whatever queued while the
# previous one ran), and off (one request at a time).
MODES = {"on": [], "on-nowait": ["--max-delay-ms", "0"], "off": ["--max-batch", "1"]}
STARTUP_SECONDS = 120


@contextmanager
def serve_process(model: str | Path, *flags: str) -> Iterator[str]:
    """``python -m classify.serve`` on a free port of 127.0.0.1 (port 0; the server prints the address),
    on the CPU: this is a CPU load test (threads, worker processes, the threads' wait policy) and its
    model-alone reference runs on the CPU, so a GPU the machine has is not used. Yields its base URL and
    stops it (SIGINT, then SIGKILL) however the block ends. Its log goes to a file, not a pipe, so a chatty
    server can never block on a full pipe."""
    with tempfile.TemporaryFile("w+", encoding="utf-8") as log:
        process = subprocess.Popen([sys.executable, "-m", "classify.serve", "--model", str(model), "--port", "0",
                                    "--device", "cpu", *flags], stdout=subprocess.DEVNULL, stderr=log)
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
    return [texts[i] for i in rng.choice(len(texts), size=min(n, len(texts)), replace=False)]


class Failure(NamedTuple):
    """A request not answered 200."""
    kind: str     # the HTTP status ("503": the server shed load) or the transport error's name
    detail: str   # the start of the answer's body, or the error's message

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


async def post_review(http, url: str, text: str) -> Failure | None:
    """POST one review to /v1/predict: None when answered 200, else what went wrong."""
    import aiohttp

    try:
        async with http.post(f"{url}/v1/predict", json={"text": text}) as r:
            body = await r.read()
            return None if r.status == 200 else Failure(str(r.status), body[:200].decode(errors="replace"))
    except (aiohttp.ClientError, asyncio.TimeoutError) as err:
        return Failure(type(err).__name__, str(err))


def failure_report(failures: list[Failure]) -> dict:
    """The failures for a record: how many, how many of each kind, and the first three."""
    return {"failures": len(failures), "failure_kinds": dict(Counter(f.kind for f in failures)),
            "failure_examples": [str(f) for f in failures[:3]]}


async def batch_stats(http, url: str, workers: int = 1) -> dict[int, dict]:
    """Each server process's batch counts (GET /v1/model), by process id: batches, texts, and the sizes of the last
    100. With --workers each process batches on its own: every request goes on a fresh connection, which the
    kernel hands to one of them, until all ``workers`` have answered (a bounded number of tries)."""
    stats: dict[int, dict] = {}
    for _ in range(50 * workers):
        async with http.get(f"{url}/v1/model", headers={"Connection": "close"}) as r:
            runtime = (await r.json())["runtime"]
        stats[runtime["process"]] = runtime["batches"]
        if len(stats) == workers:
            return stats
    raise RuntimeError(f"only {len(stats)} of the server's {workers} worker processes answered GET /v1/model")


async def all_workers_up(url: str, workers: int) -> None:
    """Wait until every worker process answers (each loads the model after the command prints its address)."""
    import aiohttp

    deadline = time.monotonic() + STARTUP_SECONDS
    async with aiohttp.ClientSession() as http:
        while True:
            try:
                await batch_stats(http, url, workers)
                return
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)


def batches_between(before: dict[int, dict], after: dict[int, dict]) -> dict:
    """What every process ran between two ``batch_stats``: texts, batches, and the sizes of those batches (each
    process's last 100 at most). A process that was not there before (a replaced worker) counts from zero."""
    empty = {"texts": 0, "batches": 0}
    ran = {pid: after[pid]["batches"] - before.get(pid, empty)["batches"] for pid in after}
    return {"texts": sum(after[pid]["texts"] - before.get(pid, empty)["texts"] for pid in after),
            "batches": sum(ran.values()),
            "recent_batches": [size for pid in after if ran[pid] > 0 for size in after[pid]["recent"][-ran[pid]:]]}


async def load_round(url: str, reviews: list[str], clients: int, workers: int = 1) -> dict:
    """``clients`` concurrent clients send one review per request until every review is answered:
    the latencies (s), the failures, the wall time, the load generator's own CPU time, and the texts
    and batches the server ran meanwhile.

    The clients are aiohttp's: on two CPUs the load generator shares the machine with the server, and
    httpx's async client spent about 20 ms of CPU per request at 128 clients (a whole core), so the
    test measured the client rather than the server."""
    import aiohttp

    queue = iter(reviews)   # shared: each client takes the next review (a bounded loop: len(reviews) requests)
    latencies: list[float] = []
    failures: list[Failure] = []

    async def client(http: aiohttp.ClientSession) -> None:
        for text in queue:
            start = time.perf_counter()
            if (failure := await post_review(http, url, text)) is not None:
                failures.append(failure)
            latencies.append(time.perf_counter() - start)

    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as http:
        before = await batch_stats(http, url, workers)
        start, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        after = await batch_stats(http, url, workers)
    return {"latencies": latencies, "failures": failures, "seconds": seconds, "client_cpu": cpu,
            **batches_between(before, after)}


def summary(clients: int, rounds: list[dict]) -> dict:
    ms = np.array([x for r in rounds for x in r["latencies"]]) * 1000
    failures = [f for r in rounds for f in r["failures"]]
    seconds = sum(r["seconds"] for r in rounds)
    return {"clients": clients, "requests": len(ms), "rounds": len(rounds), **failure_report(failures),
            "seconds": round(seconds, 2),
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


async def open_loop_round(url: str, reviews: list[str], rate: float, seconds: float, seed: int,
                          workers: int = 1) -> dict:
    """Requests at ``rate`` per second for ``seconds``, their gaps drawn from an exponential distribution
    (Poisson arrivals), each sent when due whatever the earlier ones are doing. Latency runs from when the
    request was due, so time the generator itself was late counts against the server, not for it."""
    import aiohttp

    due = np.cumsum(np.random.default_rng(seed).exponential(1 / rate, size=max(1, round(rate * seconds))))
    latencies: list[float] = []
    failures: list[Failure] = []
    late: list[float] = []

    async def one(http: aiohttp.ClientSession, text: str, at: float) -> None:
        if (failure := await post_review(http, url, text)) is not None:
            failures.append(failure)
        latencies.append(time.perf_counter() - at)

    # No connection limit: a limit would queue requests in the client, which is the closed loop again.
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as http:
        before = await batch_stats(http, url, workers)
        tasks = []
        start, cpu = time.perf_counter(), time.process_time()
        for i, offset in enumerate(due):
            at = start + offset
            if (wait := at - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            late.append(time.perf_counter() - at)
            tasks.append(asyncio.create_task(one(http, reviews[i % len(reviews)], at)))
        await asyncio.gather(*tasks)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        ran = batches_between(before, await batch_stats(http, url, workers))
    ms = np.array(latencies) * 1000
    return {"target_per_s": round(rate, 1), "offered_per_s": round(len(due) / due[-1], 1), "requests": len(ms),
            **failure_report(failures), "served_per_s": round((len(ms) - len(failures)) / wall, 1),
            **{f"p{q}_ms": round(float(np.percentile(ms, q)), 1) for q in (50, 95, 99)},
            "max_send_late_ms": round(max(late) * 1000, 1), "client_cpu_ms": round(cpu / len(ms) * 1000, 2),
            "mean_batch": round(ran["texts"] / max(ran["batches"], 1), 1)}


def model_alone(model: str, reviews: list[str], sizes: list[int], threads: int, precision: str, limits: dict,
                workers: int = 1, seconds: float = 10.0, backend: str = "torch", *,
                wait_policy: str | None) -> dict:
    """Reviews/s of the model alone (no HTTP) on batches of ``sizes`` texts, through ``inference.classify_texts``
    with the server's batching settings, as a server worker calls it: in ``workers`` processes at once (as many as
    the server ran, each with its backend, threads and precision and its share of the batches), each going round its
    batches for ``seconds`` after a warm-up, all started together. The sum of their reviews/s.

    ``wait_policy``: the processes' ``OMP_WAIT_POLICY`` (how PyTorch's idle threads wait; libgomp reads it when
    a process starts); None: unset, libgomp's default."""
    import multiprocessing
    import queue

    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(workers), ctx.Queue()
    processes = [ctx.Process(target=_model_alone_process, args=(model, reviews, sizes[k::workers] or sizes, threads,
                                                                precision, backend, limits, seconds, barrier,
                                                                results))
                 for k in range(workers)]
    with _environment("OMP_WAIT_POLICY", wait_policy):   # spawned processes copy the environment as they start
        for process in processes:
            process.start()
    try:
        counts = [results.get(timeout=STARTUP_SECONDS + 10 * seconds) for _ in processes]
    except queue.Empty:
        raise RuntimeError(f"the model-alone processes did not report (exit codes "
                           f"{[p.exitcode for p in processes]})") from None
    finally:
        for process in processes:
            process.join(10)
    return {"threads": threads, "workers": workers, "precision": counts[0]["precision"],
            "wait_policy": counts[0]["wait_policy"], "batches": len(sizes),
            "mean_batch": round(float(np.mean(sizes)), 1),
            "reviews_per_s": round(sum(c["reviews"] / c["seconds"] for c in counts), 1)}


@contextmanager
def _environment(name: str, value: str | None) -> Iterator[None]:
    """``os.environ[name] = value`` inside the block (None: unset), restored after."""
    before = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _model_alone_process(model: str, reviews: list[str], sizes: list[int], threads: int, precision: str,
                         backend: str, limits: dict, seconds: float, barrier, results) -> None:
    """One process of ``model_alone``: load, warm up, wait for the others, then run for ``seconds``."""
    import torch

    from rich.console import Console

    from classify.inference import classify_texts, open_run

    # The server's backend, threads and precision, as its worker opens the model.
    settings = argparse.Namespace(backend=backend, device="cpu", precision=precision, threads=threads, spelling=None)
    run = open_run(model, settings, Console(quiet=True))
    starts = np.cumsum([0, *sizes])

    def batches() -> Iterator[list[str]]:
        for first, size in zip(starts, sizes):
            yield [reviews[(first + k) % len(reviews)] for k in range(size)]

    def classify(batch: list[str]) -> None:
        classify_texts(run, batch, limits["max_batch"], max_tokens=limits["max_batch_tokens"])

    with torch.inference_mode():
        for batch in batches():
            classify(batch)   # warm-up
        barrier.wait()
        done, begin = 0, time.perf_counter()
        while time.perf_counter() - begin < seconds:
            for batch in batches():
                classify(batch)
                done += len(batch)
                if time.perf_counter() - begin >= seconds:
                    break
        # the wait policy as the backend saw it (None: libgomp's default; ONNX Runtime has no OpenMP threads)
        results.put({"reviews": done, "seconds": time.perf_counter() - begin,
                     "precision": run.backend.runtime["precision"],
                     "wait_policy": run.backend.runtime.get("omp_wait_policy")})


def run_open_loop(args: argparse.Namespace, server: dict, reviews: list[str]) -> tuple[dict, dict]:
    """One server (batching on) with ``server``'s --threads, --workers and --max-delay-ms (None: the server's
    default): its capacity closed-loop, then each fraction of it open-loop; then, with the server stopped, the model
    alone on the batch sizes the server ran at capacity. Also what the server says of its model."""
    flags = [x for name, value in server.items() if value is not None
             for x in (f"--{name.replace('_', '-')}", f"{value:g}")]
    workers = server["workers"]
    with serve_process(args.model, *flags, "--backend", args.backend, "--precision", args.precision,
                       "--log-level", "warning") as url:
        asyncio.run(all_workers_up(url, workers))
        asyncio.run(load_round(url, reviews[:20], 4, workers))   # warm up
        n = max(args.requests, 3 * args.capacity_clients)
        rounds = [asyncio.run(load_round(url, reviews[:n], args.capacity_clients, workers))
                  for _ in range(args.rounds)]
        capacity = summary(args.capacity_clients, rounds)
        print(f"{' '.join(flags)}, capacity: {json.dumps(capacity)}", flush=True)
        levels = []
        for k, fraction in enumerate(args.open_loop):
            level = asyncio.run(open_loop_round(url, reviews, fraction * capacity["requests_per_s"], args.seconds,
                                                args.seed + k, workers))
            levels.append({"fraction": fraction, **level})
            print(f"{' '.join(flags)}, {fraction:.0%} of capacity: {json.dumps(levels[-1])}", flush=True)
        with urllib.request.urlopen(f"{url}/v1/model", timeout=60) as answer:
            info = json.load(answer)
    sizes = [size for r in rounds for size in r["recent_batches"]]
    reference = functools.partial(model_alone, args.model, reviews, sizes, server["threads"], args.precision,
                                  info["runtime"]["limits"], workers, seconds=min(10.0, args.seconds),
                                  backend=args.backend)
    alone = reference(wait_policy=os.environ.get("OMP_WAIT_POLICY"))   # as this process's environment has it
    result = {"server": " ".join(flags), "backend": args.backend, "threads": server["threads"], "workers": workers,
              "max_delay_ms": info["runtime"]["limits"]["max_delay_ms"], "capacity": capacity, "open_loop": levels,
              "model_alone": alone, "efficiency": round(capacity["requests_per_s"] / alone["reviews_per_s"], 3)}
    # The server lets its idle PyTorch threads sleep (classify.serve sets OMP_WAIT_POLICY=PASSIVE), where this
    # process's own environment may let them spin: the model alone as the server runs it too, so that the loss to
    # HTTP and the load generator is told apart from the threads' cost of waking up.
    served_policy = info["runtime"].get("omp_wait_policy")
    if args.backend == "torch" and served_policy != alone["wait_policy"]:
        as_served = reference(wait_policy=served_policy)
        result |= {"model_alone_as_served": as_served,
                   "efficiency_as_served": round(capacity["requests_per_s"] / as_served["reviews_per_s"], 3)}
    return result, info


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
                      f"{lv['p99_ms']} | {_failures(lv)} | {lv['mean_batch']} | {lv['client_cpu_ms']} |"
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


def open_loop_markdown(result: dict) -> str:
    lines = [f"# Serving load test, open loop ({result['date']})", "",
             f"Command: `{result['command']}`", "",
             f"Model: {result['model']['id']} ({result['model']['parameters']:,} parameters, "
             f"max_len {result['model']['sizes']['max_len']}); single real IMDB test reviews; server limits "
             f"besides each server's own flags {result['server_limits']}; {result['cpu_count']} CPUs ({result['cpu_model']}), flags: "
             f"{', '.join(result['cpu_flags']) or 'none of note'}; load average before/after: "
             f"{result['load_before']} / {result['load_after']}.", ""]
    for r in result["runs"].values():
        c, alone, served = r["capacity"], r["model_alone"], r.get("model_alone_as_served")
        together = f", in {alone['workers']} processes at once" if alone["workers"] > 1 else ""
        window = "" if "--max-delay-ms" in r["server"] else f" (--max-delay-ms {r['max_delay_ms']:g})"
        lines += [f"## {r['server']}{window}, precision {alone['precision']}", "",
                  f"Capacity (closed loop, {c['clients']} clients, {c['requests']} requests in {c['rounds']} rounds): "
                  f"**{c['requests_per_s']} reviews/s**, p50 {c['p50_ms']} ms, p99 {c['p99_ms']} ms, "
                  f"{c['failures']} failures, mean batch {c['mean_batch']}. The model alone on the same "
                  f"{alone['batches']} batches (mean {alone['mean_batch']} texts{together}): "
                  f"{alone['reviews_per_s']} reviews/s{_policy(alone, r['backend'])}. "
                  f"Serving efficiency: **{r['efficiency']:.0%}**"
                  + ("." if served is None else
                     f"; against the model alone with its threads waiting as the server's do"
                     f"{_policy(served, r['backend'])}, {served['reviews_per_s']} reviews/s: "
                     f"**{r['efficiency_as_served']:.0%}**."), "",
                  "| load | target/s | offered/s (drawn) | served/s | requests | p50 ms | p95 ms | p99 ms | failures "
                  "| mean batch | sender late, max ms | client CPU ms/request |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {lv['fraction']:.0%} | {lv['target_per_s']} | {lv['offered_per_s']} | {lv['served_per_s']} | "
                  f"{lv['requests']} | "
                  f"{lv['p50_ms']} | {lv['p95_ms']} | {lv['p99_ms']} | {_failures(lv)} | {lv['mean_batch']} | "
                  f"{lv['max_send_late_ms']} | {lv['client_cpu_ms']} |" for lv in r["open_loop"]]
        lines.append("")
    return "\n".join(lines)


def _failures(level: dict) -> str:
    """A level's failures for a table cell, with their kinds: "0", or e.g. "143 (503: 143)"."""
    kinds = ", ".join(f"{kind}: {n}" for kind, n in level["failure_kinds"].items())
    return f"{level['failures']} ({kinds})" if kinds else "0"


def _policy(alone: dict, backend: str) -> str:
    """How the reference's PyTorch threads waited, for the report (ONNX Runtime has threads of its own)."""
    if backend == "onnx":
        return ""
    return f" (OMP_WAIT_POLICY={alone['wait_policy']})" if alone.get("wait_policy") else " (libgomp's default wait)"


def cpu_has_bf16() -> bool:
    return "avx512_bf16" in cpu_flags()


# The flags that decide how fast the model runs on a CPU: vector width, bf16 arithmetic, matrix units.
NOTED_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_flags() -> list[str]:
    try:
        flags = set(re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M).group(1).split())
    except (OSError, AttributeError):
        return []
    return [f for f in NOTED_FLAGS if f in flags]


def cpu_model() -> str:
    try:
        return re.search(r"^model name\s*:\s*(.*)$", Path("/proc/cpuinfo").read_text(), re.M).group(1)
    except (OSError, AttributeError):
        return "unknown CPU"


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
    g = p.add_argument_group("open loop")
    g.add_argument("--open-loop", type=float, nargs="+", metavar="FRACTION",
                   help="run the open-loop test instead: requests arriving at these fractions of the measured "
                        "capacity, e.g. 0.5 0.8 0.95")
    g.add_argument("--capacity-clients", type=int, default=32, help="closed-loop clients that measure the capacity")
    g.add_argument("--seconds", type=float, default=20.0, help="how long each open-loop level runs")
    g.add_argument("--max-delay-ms", type=float, nargs="+",
                   help="the server's --max-delay-ms, each in turn (default: the server's own default)")
    g.add_argument("--workers", type=int, nargs="+", default=[1],
                   help="the server's --workers, each in turn (the model-alone reference then runs as many "
                        "processes at once)")
    g.add_argument("--precision", default="auto", help="the server's --precision (and the model-alone reference's)")
    g.add_argument("--backend", choices=("torch", "onnx"), default="torch",
                   help="the server's --backend (and the model-alone reference's); with onnx, --model is a folder "
                        "written by classify.export")
    return p


def main_open_loop(args: argparse.Namespace, argv: list[str] | None) -> int:
    # Distinct reviews for a level of up to 500 requests/s (a file with fewer is used round and round).
    reviews = sample_reviews(args.data, max(args.requests, 3 * args.capacity_clients, round(args.seconds * 500)),
                             args.seed)
    load_before = [round(x, 2) for x in os.getloadavg()]
    runs, server = {}, {}
    for threads, workers, delay in itertools.product(args.threads, args.workers, args.max_delay_ms or [None]):
        run, server = run_open_loop(args, {"threads": threads, "workers": workers, "max_delay_ms": delay}, reviews)
        runs[run["server"]] = run
    result = {"date": time.strftime("%Y-%m-%d %H:%M"),
              "command": "python -m experiments.serve_load " + " ".join(argv if argv is not None else sys.argv[1:]),
              "model": {k: server[k] for k in ("id", "parameters", "sizes")},
              "server_limits": server["runtime"]["limits"], "cpu_count": os.cpu_count(), "cpu_model": cpu_model(),
              "cpu_flags": cpu_flags(), "cpu_bf16": cpu_has_bf16(), "load_before": load_before,
              "load_after": [round(x, 2) for x in os.getloadavg()], "runs": runs}
    write(result, open_loop_markdown(result), args.output)
    return 0


def write(result: dict, report: str, output: Path | None) -> None:
    print(report)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        output.with_suffix(".md").write_text(report, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.open_loop:
        return main_open_loop(args, argv)
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
    write(result, markdown(result), args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
