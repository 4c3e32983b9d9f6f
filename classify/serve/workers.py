"""Several server processes on one port: ``python -m classify.serve --workers N``.

A server process answers with one model on one worker thread (``microbatch``), whose forward passes use the
model's ``--threads``. On a small CPU, one process whose model uses every core shares those cores with its own
event loop (HTTP, JSON) and with whatever else runs there, and an OpenMP forward pass waits for its slowest
thread: a core taken for a moment by the event loop stalls the whole pass. Several processes with one model
thread each keep the model's work on separate cores, and the kernel hands each new connection to one of the
processes waiting on the shared listening socket.

The command binds the socket and loads the run once itself, so that a bad address or run is still one line and
exit status 2 before anything starts; then uvicorn's supervisor (``uvicorn.supervisors.Multiprocess``) starts
the workers: spawned processes that load the run again (``app_from_environment``, reading the command's
settings from ``SETTINGS_ENV``) and serve. A worker that dies or hangs is replaced; SIGINT or SIGTERM stops them
all. Each worker has its own micro-batcher and queue limit (``--max-queue`` is per worker): ``/v1/model``
describes the worker that answered the request. ``/metrics`` adds up all of them, whichever answers the scrape:
the workers share a temporary folder for prometheus-client's multiprocess mode (``serve.metrics``), made here
for this command alone (a folder left by an earlier server would add its counts) and removed when it ends.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from argparse import Namespace
from typing import Any

from rich.console import Console

SETTINGS_ENV = "CLASSIFY_SERVE_SETTINGS"   # the parsed flags, as JSON, for the spawned workers


def serve_workers(settings: dict[str, Any], sock: socket.socket, workers: int, **options: Any) -> None:
    """Run ``workers`` processes serving ``settings`` (the command's parsed flags, with the run's resolved path as
    ``model``) on ``sock`` until SIGINT or SIGTERM; ``options``: uvicorn's (log level, keep-alive, ...)."""
    import uvicorn
    from uvicorn.supervisors import Multiprocess

    from .metrics import MULTIPROCESS_ENV

    os.environ[SETTINGS_ENV] = json.dumps(settings)   # spawned processes inherit the environment
    with tempfile.TemporaryDirectory(prefix="classify-metrics-") as shared:
        os.environ[MULTIPROCESS_ENV] = shared
        config = uvicorn.Config(f"{__name__}:app_from_environment", factory=True, workers=workers, **options)
        Multiprocess(config, sockets=[sock]).run()


def app_from_environment():
    """The application of one worker process (uvicorn calls it there): the run loaded with the settings of
    ``SETTINGS_ENV``, quietly (the command has already announced the model)."""
    from ..inference import open_run
    from .app import model_app

    args = Namespace(**json.loads(os.environ[SETTINGS_ENV]))
    return model_app(open_run(args.model, args, Console(stderr=True, quiet=True)), args)
