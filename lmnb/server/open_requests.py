"""The native API's requests in flight by their ids (the caller's `rid`, else `meta_info.id`):
what SGLang's `POST /abort_request` finds. Requests of one `/generate` call share a stream;
aborting one of them ends it alone, the others go on."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Protocol

from lmnb.server.errors import APIError


class RequestsStream(Protocol):
    """The stream of one `/generate` call (`OutputStream`): its requests' engine ids in order."""

    @property
    def rids(self) -> tuple[int, ...]: ...

    def abort(self, rid: int) -> None: ...

    def close(self) -> None: ...


class OpenRequests:
    """id -> the stream serving it and the request's engine id, while its response is produced
    (used from the event loop only). Aborting one request has the runtime end it (its KV freed)
    with finish_reason `abort`, which its stream delivers; `abort_all` closes every stream, and
    the route ends their unfinished requests with finish_reason `abort`."""

    def __init__(self) -> None:
        self._streams: dict[str, tuple[RequestsStream, int]] = {}

    def check_free(self, ids: Sequence[str], stream: RequestsStream) -> None:
        """A 400, closing `stream` (whose requests these are), when one of `ids` is in flight
        already."""
        taken = sorted(set(ids) & set(self._streams))
        if taken:
            stream.close()
            raise APIError(f"rid {taken[0]!r} is already in use by a running request",
                           param="rid")

    @contextlib.contextmanager
    def tracked(self, ids: Sequence[str], stream: RequestsStream) -> Iterator[None]:
        """`ids` (one per request of `stream`, in order) find it within the block (after
        `check_free`)."""
        self.check_free(ids, stream)
        self._streams.update(zip(ids, ((stream, rid) for rid in stream.rids), strict=True))
        try:
            yield
        finally:
            for rid in ids:
                if self._streams.get(rid, (None,))[0] is stream:
                    del self._streams[rid]

    def abort(self, rid: str) -> None:
        """Aborts the request `rid`; an id not in flight (finished, unknown) is a no-op, as in
        SGLang."""
        if rid in self._streams:
            stream, engine_rid = self._streams[rid]
            stream.abort(engine_rid)

    def abort_all(self) -> None:
        for stream in {stream for stream, _ in self._streams.values()}:
            stream.close()
