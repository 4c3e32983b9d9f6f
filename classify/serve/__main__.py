"""python -m classify.serve: the classifier behind an HTTP API and a web page.

    python -m classify.serve --model runs/imdb-default
    curl -s localhost:8000/v1/predict -H 'Content-Type: application/json' -d '{"texts": ["A wonderful film."]}'

The run is loaded before the server starts, so a run folder that cannot be loaded is one line on
stderr and exit status 2, as with the other commands.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys

# Before torch loads: libgomp reads this once. Its threads spin for a while after each parallel region by
# default, on the cores the event loop needs for the next requests and the last answers; sleeping ones serve
# 13% more requests/s on two threads (experiments/RESULTS.md, fifteenth session). The user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from rich.console import Console  # noqa: E402

from ..engine.config import HelpFormatter, InferenceConfig, add_flags, from_args  # noqa: E402
from ..errors import ClassifyError, run_cli  # noqa: E402
from ..inference import RUNS_DIR, open_run  # noqa: E402
from .limits import Limits  # noqa: E402

ENV_KEY = "CLASSIFY_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m classify.serve",
        description="Serve a trained classifier over HTTP: POST /v1/predict and /v1/explain, GET /v1/model, "
                    "/healthz, /readyz, /metrics (Prometheus), the OpenAPI page at /docs and a web page at /. "
                    "Concurrent requests are answered together in length-bucketed batches by one worker thread.",
        formatter_class=HelpFormatter,
    )
    g = p.add_argument_group("model")
    g.add_argument("--model", help=f"run folder, or with --backend onnx a folder written by classify.export "
                                   f"(default: the newest of its kind under {RUNS_DIR}/)")
    add_flags(g, InferenceConfig)
    g = p.add_argument_group("HTTP")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"), default="info",
                   help="uvicorn's log level")
    g.add_argument("--access-log", action="store_true", help="log every request (costs time under load)")
    g.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' on /v1/* (401 otherwise); the page, "
                                     f"/healthz, /readyz and /metrics stay open. Default: ${ENV_KEY}, which "
                                     f"keeps the key out of the process list")
    g.add_argument("--workers", type=int, default=1,
                   help="server processes sharing the port, each with its own copy of the model using --threads "
                        "threads (a dead one is replaced): one-thread workers keep each model on a core of its own "
                        "(docs/serving.md says what was measured). Each worker batches, bounds its queue and "
                        "counts its metrics on its own")
    add_flags(p.add_argument_group("batching and limits"), Limits)
    return p


def exposure_warning(address: str, api_key: str | None) -> str | None:
    """A warning when ``address`` (the IP the server listens on) is reachable from other machines and no API
    key is set: anyone who can reach the port may then use the model."""
    if api_key or ipaddress.ip_address(address.split("%")[0]).is_loopback:
        return None
    return (f"warning: listening on {address} without an API key: anyone who can reach this port can use the "
            f"API; set --api-key or ${ENV_KEY} (or listen on 127.0.0.1)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    limits = from_args(Limits, args)   # checks the limits before anything starts
    args.api_key = args.api_key or os.environ.get(ENV_KEY) or None
    if not 0 <= args.port <= 65535:
        raise ClassifyError(f"--port must be between 0 and 65535, got {args.port}")
    if args.workers < 1:
        raise ClassifyError(f"--workers must be at least 1, got {args.workers}")
    try:
        import uvicorn

        from .app import model_app
        from .workers import serve_workers
    except ImportError as err:
        raise ClassifyError(f"serving needs the serve extra ({err}): pip install -e '.[serve]'") from None
    # Bind first, and here rather than in uvicorn: a busy port is a one-line error (exit 2) before the
    # model is loaded, and the address printed is the real one even for --port 0, whatever the log level.
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    try:
        sock = socket.create_server((args.host, args.port), family=family, backlog=2048)
    except OSError as err:
        raise ClassifyError(f"cannot listen on {args.host} port {args.port}: {err.strerror or err}") from None
    with sock:
        console = Console(stderr=True)
        run = open_run(args.model, args, console)   # with --workers, only to check it: each worker loads its own
        host, port = sock.getsockname()[:2]
        if warning := exposure_warning(host, args.api_key):
            console.print(warning, style="yellow", highlight=False, soft_wrap=True)
        workers = f" with {args.workers} worker processes" if args.workers > 1 else ""
        console.print(f"listening on http://{f'[{host}]' if family == socket.AF_INET6 else host}:{port}{workers} "
                      f"(the page at /, API docs at /docs; Ctrl+C stops)", highlight=False, soft_wrap=True)
        options = {"log_level": args.log_level, "access_log": args.access_log,
                   "timeout_keep_alive": limits.keep_alive_s}
        if args.workers == 1:
            uvicorn.Server(uvicorn.Config(model_app(run, args), **options)).run(sockets=[sock])
        else:
            settings = {**vars(args), "model": str(run.path)}
            del run
            serve_workers(settings, sock, args.workers, **options)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, prog="classify.serve"))
