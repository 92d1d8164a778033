"""The gateway's ASGI plumbing around FastAPI: what every request passes, kept to plain ASGI
so that nothing wraps a streamed response's `send` (gateway/openai/sse.py sends each event as one
body message).

    Authorize          API keys on /v1/*, /tokenize, /detokenize (only with keys)
    GenerationRoutes   POSTs to the generation endpoints straight to their handlers; every
                       other request to the FastAPI app (its router and middleware)
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from gateway.auth import APIKeys, bearer_token

logger = logging.getLogger(__name__)
KEYED_PATHS = ("/v1/", "/tokenize", "/detokenize", "/tokenizer_info")  # need a key when set


def error(status: int, message: str, param: str | None = None, code: str | None = None,
          kind: str = "invalid_request_error") -> JSONResponse:
    """OpenAI's error shape."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": code}}, status_code=status)


class Authorize:
    """Pure ASGI middleware: with API keys, /v1/*, /tokenize and /detokenize need
    `Authorization: Bearer <key>` (401 otherwise). Nothing wraps the response: a streamed
    one's events go straight through."""

    def __init__(self, app, keys: APIKeys, on_reject: Callable[[str], None]) -> None:
        self.app, self.keys, self.on_reject = app, keys, on_reject

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(KEYED_PATHS):
            auth = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            if not self.keys.admits(bearer_token(auth.decode("latin-1") if auth else None)):
                self.on_reject("unauthenticated")
                await error(401, "a valid API key is required: header 'Authorization: "
                            "Bearer <key>'", kind="invalid_api_key")(scope, receive, send)
                return
        await self.app(scope, receive, send)


class GenerationRoutes:
    """Pure ASGI: POSTs to the generation endpoints go to their handlers directly, every
    other request to `app` (FastAPI). Their requests pass no middleware, router or
    exception wrapper (each of which wraps `send`, once per streamed event); a handler's
    unexpected error is a 500 here, logged."""

    def __init__(self, app, routes: dict[str, Callable[[Request], Awaitable[Response]]]) -> None:
        self.app, self.routes = app, routes

    async def __call__(self, scope, receive, send) -> None:
        handler = (self.routes.get(scope["path"])
                   if scope["type"] == "http" and scope["method"] == "POST" else None)
        if handler is None:
            await self.app(scope, receive, send)
            return
        try:
            response = await handler(Request(scope, receive))
        except Exception:
            logger.exception("%s failed", scope["path"])
            response = error(500, "internal error", kind="internal_error")
        await response(scope, receive, send)
