"""`RequestStreams`: the owner of the runtime streams the HTTP requests open, by request. Every
stream a route opens (`own`, called by `lmnb.server.streams.open_stream`) is closed when its
request's handling ends in any way: its response sent, refused, failed while being built, or
cancelled. Closing aborts the requests that have not finished (their KV freed); a stream read
to its end or closed already is left as it is. Routes still close their streams as soon as they
are done with them (a disconnect, the last chunk); this is the backstop for every other path.

`HandledRequests.abort_all` (SGLang's `/abort_request {"abort_all": true}`) aborts the runtime
requests of every HTTP request being handled, whatever its API: each ends with finish_reason
`abort`, which its stream delivers, and a stream such a request opens later (a tool call's
second request) is aborted as it opens."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Protocol, TypeVar

from starlette.types import ASGIApp, Receive, Scope, Send


class Closable(Protocol):
    def close(self) -> None: ...


class RequestsStream(Closable, Protocol):
    """The stream of one generate call (`OutputStream`): its requests' engine ids in order."""

    @property
    def rids(self) -> tuple[int, ...]: ...

    @property
    def closed(self) -> bool:
        """Closed: no more output comes, its unfinished requests were aborted."""
        ...

    def abort(self, rid: int) -> None:
        """Ends request `rid` (if unfinished) with finish_reason `abort`, delivered as its last
        chunk."""
        ...


S = TypeVar("S", bound=RequestsStream)


def _abort_requests(stream: RequestsStream) -> None:
    for rid in stream.rids:
        stream.abort(rid)


class _Opened:
    """The streams one HTTP request opened; `aborted` once `abort_all` reached it."""

    def __init__(self) -> None:
        self.streams: list[RequestsStream] = []
        self.aborted = False

    def add(self, stream: RequestsStream) -> None:
        self.streams.append(stream)
        if self.aborted:
            _abort_requests(stream)

    def abort(self) -> None:
        self.aborted = True
        for stream in self.streams:
            _abort_requests(stream)


# The streams of the request being handled (tasks a request spawns, such as a streamed body,
# share them); None outside a request.
_opened: ContextVar[_Opened | None] = ContextVar("lmnb_request_streams", default=None)


def own(stream: S) -> S:
    """`stream`, closed when the current request's handling ends (outside a request: as is);
    its requests aborted at once if `abort_all` reached the request already."""
    opened = _opened.get()
    if opened is not None:
        opened.add(stream)
    return stream


class HandledRequests:
    """The HTTP requests being handled, each with the streams it opened (one per app, used from
    its event loop only)."""

    def __init__(self) -> None:
        self._handled: set[_Opened] = set()

    @contextlib.contextmanager
    def handling(self) -> Iterator[None]:
        """Within the block (a request's handling), `own` gives the request its streams; they
        are closed when it ends."""
        opened = _Opened()
        self._handled.add(opened)
        token = _opened.set(opened)
        try:
            yield
        finally:
            _opened.reset(token)
            self._handled.discard(opened)
            for stream in opened.streams:
                stream.close()

    def abort_all(self) -> None:
        """Aborts the runtime requests of every request being handled, and those it opens
        later."""
        for opened in list(self._handled):
            opened.abort()


class RequestStreams:
    """ASGI middleware: each HTTP request is handled within `requests.handling()`."""

    def __init__(self, app: ASGIApp, requests: HandledRequests) -> None:
        self.app = app
        self.requests = requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        with self.requests.handling():
            await self.app(scope, receive, send)
