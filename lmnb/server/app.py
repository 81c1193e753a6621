"""`create_app(runtime)`: the FastAPI app serving one in-process `Runtime` through OpenAI's,
SGLang's native, Anthropic's and Ollama's APIs."""

from __future__ import annotations

import hmac
import json
from collections.abc import Sequence

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from lmnb.server import anthropic, ollama, openai_api, replica_api, sglang_native
from lmnb.server.errors import error_body, install_error_handlers
from lmnb.server.limits import DEFAULT_MAX_REQUEST_BYTES, BodyLimit, max_token_bytes
from lmnb.server.open_requests import OpenRequests
from lmnb.server.request_id import RequestId
from lmnb.server.request_streams import HandledRequests, RequestStreams
from lmnb.server.streams import ServedRuntime

OPEN_PATHS = frozenset({"/health"})
ALL_ORIGINS = ("*",)


class BearerAuth:
    """ASGI middleware: every HTTP path but `OPEN_PATHS` needs `Authorization: Bearer KEY`
    (or Anthropic's `x-api-key: KEY`); otherwise 401 with the route's error body."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    def _allowed(self, headers: dict[bytes, bytes]) -> bool:
        auth = headers.get(b"authorization", b"")
        token = auth[7:].strip() if auth[:7].lower() == b"bearer " else headers.get(b"x-api-key")
        return token is not None and hmac.compare_digest(token, self._key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._allowed(
                dict(scope["headers"])):
            await self.app(scope, receive, send)
            return
        body = json.dumps(error_body("missing or wrong API key (Authorization: Bearer KEY)",
                                     type="authentication_error", code="invalid_api_key",
                                     path=scope["path"]))
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body.encode()})


def default_model_name(runtime: ServedRuntime) -> str:
    return runtime.model_dir.name


def create_app(runtime: ServedRuntime, *, api_key: str | None = None,
               served_model_name: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               allowed_origins: Sequence[str] = ALL_ORIGINS) -> FastAPI:
    """The app over `runtime` (not owned: closing the app leaves the runtime running). With
    `api_key`, every route but `/health` needs it. A body over `max_request_bytes` is refused
    (413) before it is read. Every response has a request id (`x-request-id`, `request-id`).
    Browsers on `allowed_origins` (default all, as SGLang's and vLLM's servers; none: no CORS
    headers) may call every route with any method and header; preflights need no key. Every
    runtime stream a request opens is closed when the request ends, whatever ended it, and
    `/abort_request {"abort_all": true}` aborts those of every request (`RequestStreams`)."""
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    name = served_model_name or default_model_name(runtime)
    max_token_bytes(runtime.tokenizer)  # the prompt check's bound, once, before serving
    app = FastAPI(title="lmnb", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    open_requests = OpenRequests()  # by rid, for /abort_request
    handled = HandledRequests()  # every request's streams, for abort_all
    app.include_router(openai_api.make_router(runtime, name, open_requests))
    app.include_router(sglang_native.make_router(runtime, name, open_requests, handled))
    for module in (anthropic, ollama, replica_api):
        app.include_router(module.make_router(runtime, name))
    app.include_router(anthropic.count_tokens_router(runtime))
    app.state.runtime = runtime
    app.state.served_model_name = name
    # innermost: the routes' streams end with the request
    app.add_middleware(RequestStreams, requests=handled)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    if api_key:  # runs before any body is read
        app.add_middleware(BearerAuth, api_key=api_key)
    if allowed_origins:  # outside the key check: preflights carry no key, and a 401 reaches JS
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins),
                           allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(RequestId)  # added last: runs first, so that every response has it
    return app
