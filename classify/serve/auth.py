"""Who may use the API: an optional bearer key for ``/v1/*`` (``--api-key``).

Only the API needs the key. The web page (which asks for the key and sends it), ``/healthz`` and ``/readyz``
(load balancers and orchestrators probe them without secrets), ``/metrics`` (counts only, no text; scrapers
sit inside the network) and the OpenAPI page stay open.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import error_response

PROTECTED = "/v1/"


class BearerAuth:
    """ASGI middleware: a request under ``/v1/`` without ``Authorization: Bearer <key>`` gets 401 with
    ``WWW-Authenticate: Bearer`` and a JSON error, before its body is read."""

    def __init__(self, app: ASGIApp, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED):
            await self.app(scope, receive, send)
            return
        scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        if scheme.lower() != b"bearer" or not token.strip():
            await error_response(401, "this API needs a key: send the header 'Authorization: Bearer KEY' "
                                      "(the key the server was started with, --api-key or $CLASSIFY_API_KEY)",
                                 headers={"WWW-Authenticate": 'Bearer realm="classify"'})(scope, receive, send)
        # compare_digest: the time taken does not depend on how much of a guessed key is right.
        elif not hmac.compare_digest(token.strip(), self.key):
            await error_response(401, "the API key is wrong", headers={
                "WWW-Authenticate": 'Bearer realm="classify", error="invalid_token"'})(scope, receive, send)
        else:
            await self.app(scope, receive, send)

