"""`RequestStreams`: the owner of the runtime streams a request opens. Every stream a route
opens (`own`, called by `lmnb.server.streams.open_stream`) is closed when the request's
handling ends in any way: its response sent, refused, failed while being built, or cancelled.
Closing aborts the requests that have not finished (their KV freed); a stream read to its end
or closed already is left as it is. Routes still close their streams as soon as they are done
with them (a disconnect, the last chunk); this is the backstop for every other path."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Protocol, TypeVar

from starlette.types import ASGIApp, Receive, Scope, Send


class Closable(Protocol):
    def close(self) -> None: ...


S = TypeVar("S", bound=Closable)

# The streams of the request being handled (tasks a request spawns, such as a streamed body,
# share its list); None outside a request.
_opened: ContextVar[list[Closable] | None] = ContextVar("lmnb_request_streams", default=None)


def own(stream: S) -> S:
    """`stream`, closed when the current request's handling ends (outside a request: as is)."""
    opened = _opened.get()
    if opened is not None:
        opened.append(stream)
    return stream


class RequestStreams:
    """ASGI middleware: closes each stream an HTTP request opened once the app is done with
    the request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        opened: list[Closable] = []
        token = _opened.set(opened)
        try:
            await self.app(scope, receive, send)
        finally:
            _opened.reset(token)
            for stream in opened:
                stream.close()
