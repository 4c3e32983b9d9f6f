"""The FastAPI application: routes, the web page, the middleware around them, and the micro-batch worker's
life cycle.

Routes only translate between HTTP and ``ModelService``; all model work is handed to the
``MicroBatcher`` thread and awaited, so the event loop stays free to take requests meanwhile.
Middleware, outermost first: request metrics, the X-Model-Version header, the API key, the body limit.
"""

from __future__ import annotations

import asyncio
import os
from argparse import Namespace
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..engine.config import from_args
from ..explain import pieces
from ..inference import LoadedRun, TextResult
from .auth import BearerAuth
from .errors import BodyLimit, UserError, error_response, install_handlers
from .limits import Limits
from .metrics import CONTENT_TYPE, Metrics, RequestMetrics
from .microbatch import MicroBatcher
from .schemas import (ErrorResponse, ExplainedPrediction, ExplainRequest, ExplainResponse, ModelInfo, Piece,
                      Prediction, PredictRequest, PredictResponse, Status)
from .service import ModelService

READY_TIMEOUT = 5.0   # seconds a readiness probe may wait behind queued work before it says "not ready"
READY_PROBE = "ready?"
VERSION_HEADER = "X-Model-Version"


class ModelHeader:
    """ASGI middleware: every answer names the model that gave it (``VERSION_HEADER: name@version``), so a
    client or a proxy's log can tell which weights answered across a deploy."""

    def __init__(self, app: ASGIApp, model_id: str):
        self.app, self.header = app, (VERSION_HEADER.lower().encode(), model_id.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        await self.app(scope, receive, send_with_header if scope["type"] == "http" else send)


def _prediction(result: TextResult, labels: list[str]) -> dict:
    return {"label": result.label, "score": result.score,
            "probabilities": {name: float(p) for name, p in zip(labels, result.probabilities)},
            "notes": result.notes}


def _check_count(texts: list[str], most: int, flag: str) -> None:
    if len(texts) > most:
        raise UserError(f"{len(texts)} texts in one request, but this server takes at most {most} "
                        f"(its {flag}); send them over several requests")


def _check_read(results: list[TextResult]) -> None:
    """Every text must leave words to read; say which did not."""
    empty = [i for i, r in enumerate(results) if r.probabilities is None]
    if not empty:
        return
    if len(results) == 1:
        raise UserError("the text is empty (nothing is left once HTML markup and spaces are removed): "
                        "write a review to classify")
    raise UserError(f"{', '.join(f'texts[{i}]' for i in empty)} "
                    f"{'is' if len(empty) == 1 else 'are'} empty once HTML markup and spaces are removed; "
                    f"give a review in each")


def model_app(run: LoadedRun, args: Namespace) -> FastAPI:
    """The application for a loaded run and the command's parsed flags (the limits; ``api_key``, already
    resolved from --api-key or the environment)."""
    limits = from_args(Limits, args)
    return create_app(ModelService(run, limits.max_batch, limits.max_batch_tokens), limits, args.api_key)


def create_app(service: ModelService, limits: Limits = Limits(), api_key: str | None = None) -> FastAPI:
    """The application for one loaded model; with ``api_key``, ``/v1/*`` need it as a bearer token. Its
    worker thread starts and stops with the app's lifespan (uvicorn, or ``with TestClient(app)``)."""
    metrics = Metrics(service.identity)
    batcher: MicroBatcher[TextResult] = MicroBatcher(service.predict, limits.max_batch, limits.max_delay_ms / 1000,
                                                     limits.max_queue, listener=metrics)
    labels = service.run.labels
    page = resources.files(__package__).joinpath("page.html").read_text(encoding="utf-8")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        batcher.start()
        try:
            yield
        finally:
            batcher.stop()

    app = FastAPI(title="classify", version="1", lifespan=lifespan,
                  description="Sentiment of movie reviews from a trained classify run. Errors are JSON: "
                              "{error, status, details?}.",
                  responses={422: {"model": ErrorResponse}, 413: {"model": ErrorResponse},
                             400: {"model": ErrorResponse}, 503: {"model": ErrorResponse}})
    app.state.batcher = batcher
    # The 500 answer is made outside all middleware (Starlette's ServerErrorMiddleware): it reads these.
    app.state.answer_headers = {VERSION_HEADER: service.id}
    install_handlers(app)
    # add_middleware wraps what was added before: the last one added runs first.
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)
    if api_key:
        app.add_middleware(BearerAuth, key=api_key)
    app.add_middleware(ModelHeader, model_id=service.id)
    app.add_middleware(RequestMetrics, metrics=metrics, routes=lambda: [r.path for r in app.routes])

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index() -> str:
        return page

    @app.post("/v1/predict", response_model=PredictResponse)
    async def predict(request: PredictRequest) -> PredictResponse:
        """Label, score and class probabilities of each text, in input order."""
        texts = request.all_texts
        _check_count(texts, limits.max_texts, "--max-texts")
        results = await batcher.predict(texts)
        _check_read(results)
        return PredictResponse(model=service.id, predictions=[Prediction(**_prediction(r, labels)) for r in results])

    @app.post("/v1/explain", response_model=ExplainResponse)
    async def explain(request: ExplainRequest) -> ExplainResponse:
        """As /v1/predict, plus each word's attribution to the predicted label (integrated gradients)."""
        texts = request.all_texts
        _check_count(texts, limits.max_explain_texts, "--max-explain-texts")
        if service.run.backend.name != "torch":
            raise UserError(f"explanations need the PyTorch model, and this server runs --backend "
                            f"{service.run.backend.name}: use /v1/predict, or serve the run folder with "
                            f"--backend torch")
        explained = await batcher.call(lambda: service.explain(texts, request.steps),
                                       weight=len(texts) * request.steps)
        _check_read([e.result for e in explained])
        predictions = []
        for e in explained:
            explanation = {"target": labels[e.explanation.target], "words": e.explanation.word_scores(),
                           "pieces": [Piece(text=t, score=s, weight=w) for t, s, w in pieces(e.explanation)]}
            predictions.append(ExplainedPrediction(**_prediction(e.result, labels), explanation=explanation))
        return ExplainResponse(model=service.id, predictions=predictions)

    @app.get("/v1/model", response_model=ModelInfo)
    async def model() -> ModelInfo:
        """The loaded run: its folder, sizes, training and test metrics; and how it is being served."""
        runtime = {**service.run.backend.runtime, "limits": asdict(limits), "batches": asdict(batcher.stats),
                   "process": os.getpid()}   # with --workers, which worker answered (each batches on its own)
        return ModelInfo(**service.describe(), runtime=runtime)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus() -> Response:
        """Counters, latency and batch-size histograms and the queue depth, for a Prometheus scraper."""
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/healthz", response_model=Status, response_model_exclude_none=True)
    async def healthz() -> Status:
        """Alive: the process answers HTTP."""
        return Status(status="ok")

    @app.get("/readyz", response_model=Status, responses={503: {"model": ErrorResponse}})
    async def readyz() -> Status | JSONResponse:
        """Ready: the model is loaded and answers a prediction through the worker within a few seconds."""
        if not batcher.alive:
            return error_response(503, "not ready: the model's worker thread is not running")
        try:
            await asyncio.wait_for(batcher.predict([READY_PROBE]), READY_TIMEOUT)
        except Exception as err:  # noqa: BLE001 - a timeout or the model's own failure: either way, not ready
            return error_response(503, f"not ready: the model did not answer ({type(err).__name__}: {err})")
        return Status(status="ready", model=service.id)

    return app
