"""Everything that goes wrong over HTTP becomes a JSON ``ErrorResponse`` with a message for a person.

User errors get their 4xx status (400 unreadable body, 404/405 wrong route or method, 413 body over
the limit, 422 a body that does not fit the API), 503 when too much work is already waiting
(``Overloaded``, with Retry-After); a bug answers 500 and the server keeps serving.
FastAPI has no request-size limit of its own: ``BodyLimit`` is one, as ASGI middleware.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .microbatch import Overloaded
from .schemas import ErrorResponse

log = logging.getLogger("classify.serve")

API_SUMMARY = ("GET / (the web page), POST /v1/predict, POST /v1/explain, GET /v1/model, GET /healthz, "
               "GET /readyz, GET /metrics, GET /docs")


class UserError(Exception):
    """A request that fits the schema but cannot be answered (too many texts, an empty one): 422."""


def error_response(status: int, message: str, details: list[str] | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorResponse(error=message, status=status, details=details)
    return JSONResponse(body.model_dump(exclude_none=True), status_code=status, headers=headers)


def _where(loc: tuple[Any, ...]) -> str:
    """('body', 'texts', 2) -> texts[2]"""
    parts = [str(p) for p in loc if p != "body"]
    return "".join(f"[{p}]" if p.isdigit() else (f".{p}" if i else p) for i, p in enumerate(parts)) or "the body"


def _describe(error: dict[str, Any]) -> str:
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        return f"unknown field '{_where(error['loc'])}' (the API takes 'text' or 'texts', and 'steps' for explain)"
    if error["type"] == "model_type" or (error["type"] == "model_attributes_type" and len(error["loc"]) <= 1):
        return 'the body must be a JSON object such as {"texts": ["a review"]}, sent as Content-Type: application/json'
    where = _where(error["loc"])
    return message if where == "the body" else f"{where}: {message}"


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if any(e["type"] == "json_invalid" for e in errors):
        reason = next(e for e in errors if e["type"] == "json_invalid").get("ctx", {}).get("error", "")
        return error_response(400, f"the request body is not valid JSON ({reason}); send e.g. "
                                   '{"texts": ["a review"]} with Content-Type: application/json')
    details = [_describe(e) for e in errors]
    return error_response(422, details[0] if len(details) == 1 else f"{len(details)} problems: " + "; ".join(details),
                          details if len(details) > 1 else None)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    route = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        message = f"there is no {route}; this server has {API_SUMMARY}"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("allow", (exc.headers or {}).get("Allow", ""))
        message = f"{request.method} is not allowed on {request.url.path}; use {allowed or 'another method'}"
    elif exc.status_code == 400 and isinstance(exc.__cause__, UnicodeDecodeError):
        # FastAPI's JSON parsing hands a body that is not UTF-8 on as a bare 400 "error parsing the body".
        cause = exc.__cause__
        message = (f"the request body is not valid UTF-8 (byte 0x{cause.object[cause.start]:02x} at position "
                   f"{cause.start}); send JSON text in UTF-8")
    else:
        message = str(exc.detail)
    return error_response(exc.status_code, message, headers=exc.headers)


async def _user_error(request: Request, exc: UserError) -> JSONResponse:
    return error_response(422, str(exc))


RETRY_AFTER_S = 1


async def _overloaded(request: Request, exc: Overloaded) -> JSONResponse:
    return error_response(503, str(exc), headers={"Retry-After": str(RETRY_AFTER_S)})


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("error answering %s %s", request.method, request.url.path)
    return error_response(500, f"internal error ({type(exc).__name__}: {exc}); the server is still running, "
                               "please report this with the request that caused it",
                          headers=getattr(request.app.state, "answer_headers", None))


def install_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(UserError, _user_error)  # type: ignore[arg-type]
    app.add_exception_handler(Overloaded, _overloaded)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _internal_error)


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` gets 413, whether its Content-Length says so up
    front or it turns out longer while streaming in (chunked uploads); the rest is never read."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes
        self.message = (f"the request body is over the limit of {max_bytes:,} bytes (the server's --max-body-mb); "
                        f"send fewer or shorter texts per request")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await error_response(413, self.message)(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # An HTTPException passes FastAPI's body parsing untouched and reaches _http_error.
                    raise HTTPException(413, self.message)
            return message

        await self.app(scope, counting_receive, send)
