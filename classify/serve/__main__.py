"""python -m classify.serve: the classifier behind an HTTP API and a web page.

    python -m classify.serve --model runs/imdb-default
    curl -s localhost:8000/v1/predict -H 'Content-Type: application/json' -d '{"texts": ["A wonderful film."]}'

The run is loaded before the server starts, so a run folder that cannot be loaded is one line on
stderr and exit status 2, as with the other commands.
"""

from __future__ import annotations

import argparse
import socket
import sys

from rich.console import Console

from ..engine.config import HelpFormatter, InferenceConfig, add_flags
from ..errors import ClassifyError, run_cli
from ..inference import RUNS_DIR, open_run
from .limits import Limits


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m classify.serve",
        description="Serve a trained classifier over HTTP: POST /v1/predict and /v1/explain, GET /v1/model, "
                    "/healthz, /readyz, the OpenAPI page at /docs and a web page at /. Concurrent requests are "
                    "answered together in length-bucketed batches by one worker thread.",
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
    g = p.add_argument_group("batching and limits")
    defaults = Limits()
    g.add_argument("--max-batch", type=int, default=defaults.max_batch,
                   help="most texts answered together; 1 = no batching (one request at a time)")
    g.add_argument("--max-batch-tokens", type=int, default=defaults.max_batch_tokens,
                   help="padded tokens per forward pass: a batch runs as length buckets of at most this many "
                        "(on a CPU, padding a short review to a long one costs more than batching saves)")
    g.add_argument("--max-delay-ms", type=float, default=defaults.max_delay_ms,
                   help="how long the first request of a batch waits for others to join it")
    g.add_argument("--max-body-mb", type=float, default=defaults.max_body_mb,
                   help="largest request body in MiB (larger: 413)")
    g.add_argument("--max-texts", type=int, default=defaults.max_texts, help="most texts in one request")
    g.add_argument("--max-explain-texts", type=int, default=defaults.max_explain_texts,
                   help="most texts in one /v1/explain request (an explanation costs about as much as "
                        "predicting 'steps' texts, and holds the worker meanwhile)")
    g.add_argument("--max-queue", type=int, default=defaults.max_queue,
                   help="most texts waiting for the model (an explanation counts as texts x steps); a request "
                        "past it is refused at once with 503 and Retry-After, so that overload cannot grow "
                        "the wait of the requests taken without bound")
    g.add_argument("--keep-alive-s", type=float, default=defaults.keep_alive_s,
                   help="seconds an idle HTTP connection stays open (above the usual clients' pool expiry, so "
                        "a pooled connection is not closed under a request that reuses it)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    limits = Limits(args.max_batch, args.max_batch_tokens, args.max_delay_ms, args.max_body_mb, args.max_texts,
                    args.max_explain_texts, args.max_queue, args.keep_alive_s)
    if not 0 <= args.port <= 65535:
        raise ClassifyError(f"--port must be between 0 and 65535, got {args.port}")
    try:
        import uvicorn

        from .app import create_app
        from .service import ModelService
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
        run = open_run(args.model, args, console)
        app = create_app(ModelService(run, limits.max_batch, limits.max_batch_tokens), limits)
        host, port = sock.getsockname()[:2]
        console.print(f"listening on http://{f'[{host}]' if family == socket.AF_INET6 else host}:{port} "
                      f"(the page at /, API docs at /docs; Ctrl+C stops)", highlight=False, soft_wrap=True)
        config = uvicorn.Config(app, log_level=args.log_level, access_log=args.access_log,
                                timeout_keep_alive=limits.keep_alive_s)
        uvicorn.Server(config).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, prog="classify.serve"))
