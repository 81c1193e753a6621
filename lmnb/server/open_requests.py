"""The native API's requests in flight by their ids (the caller's `rid`, else `meta_info.id`):
what SGLang's `POST /abort_request` finds. Requests of one `/generate` call share a stream, so
aborting one of them aborts the call."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from lmnb.server.errors import APIError
from lmnb.server.streams import Closable


class OpenRequests:
    """id -> the stream serving it, while its response is produced (used from the event loop
    only). Aborting closes the stream: the runtime aborts its unfinished requests and frees their
    KV, and the route ends each of them with finish_reason `abort`."""

    def __init__(self) -> None:
        self._streams: dict[str, Closable] = {}

    def check_free(self, ids: Sequence[str], stream: Closable) -> None:
        """A 400, closing `stream` (whose requests these are), when one of `ids` is in flight
        already."""
        taken = sorted(set(ids) & set(self._streams))
        if taken:
            stream.close()
            raise APIError(f"rid {taken[0]!r} is already in use by a running request",
                           param="rid")

    @contextlib.contextmanager
    def tracked(self, ids: Sequence[str], stream: Closable) -> Iterator[None]:
        """`ids` find `stream` within the block (after `check_free`)."""
        self.check_free(ids, stream)
        self._streams.update(dict.fromkeys(ids, stream))
        try:
            yield
        finally:
            for rid in ids:
                if self._streams.get(rid) is stream:
                    del self._streams[rid]

    def abort(self, rid: str) -> None:
        """Aborts the request `rid`; an id not in flight (finished, unknown) is a no-op, as in
        SGLang."""
        stream = self._streams.get(rid)
        if stream is not None:
            stream.close()

    def abort_all(self) -> None:
        for stream in set(self._streams.values()):
            stream.close()
