"""Requests in flight by their ids: what SGLang's `POST /abort_request` finds. The ids are the
caller's `rid` (SGLang's field on `/generate`, `/v1/completions` and `/v1/chat/completions`),
else `meta_info.id` on `/generate` and the response's id on the OpenAI routes. Requests of one
call share a stream; aborting one of them ends it alone, the others go on. (`abort_all` reaches
every request of every API: `lmnb.server.request_streams.HandledRequests`.)"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Iterator, Sequence

from lmnb.runtime.distributed.replica import output_names
from lmnb.server.errors import APIError
from lmnb.server.request_streams import RequestsStream


def caller_ids(rid: str | list[str], samples: list[int]) -> list[str]:
    """The id of each result of a call, in order (prompt-major), from the caller's `rid`, as
    SGLang names them: a string is the id of a single result (`rid_i` for each result of a
    batch or of `n` > 1), a list has one id per prompt (`rid_k` for sample k with `n` > 1)."""
    if isinstance(rid, str):
        total = sum(samples)
        return [rid] if total == 1 else [f"{rid}_{i}" for i in range(total)]
    return output_names(rid, samples)


class OpenRequests:
    """id -> the stream serving it and the request's engine id (used from the event loop
    only). A route claims its ids when it checks them, before its response starts; they are
    taken until its block (`tracked`) or its events (`tracked_events`) end, or its stream is
    closed, whichever comes first: a response whose body never ran (its client left first) holds
    them only until its request's handling ends, which closes the stream (`RequestStreams`).
    Aborting one request has the runtime end it (its KV freed) with finish_reason `abort`,
    which its stream delivers."""

    def __init__(self) -> None:
        self._streams: dict[str, tuple[RequestsStream, int]] = {}

    def _claim(self, ids: Sequence[str], stream: RequestsStream) -> None:
        """Takes `ids` (one per request of `stream`, in order) for `stream`; a 400, closing
        `stream`, when one of them is taken already."""
        self._streams = {rid: entry for rid, entry in self._streams.items()
                         if not entry[0].closed}
        taken = sorted(set(ids) & set(self._streams))
        if taken:
            stream.close()
            raise APIError(f"rid {taken[0]!r} is already in use by a running request",
                           param="rid")
        self._streams.update(zip(ids, ((stream, rid) for rid in stream.rids), strict=True))

    def _release(self, ids: Sequence[str], stream: RequestsStream) -> None:
        for rid in ids:
            if self._streams.get(rid, (None,))[0] is stream:
                del self._streams[rid]

    @contextlib.contextmanager
    def tracked(self, ids: Sequence[str], stream: RequestsStream) -> Iterator[None]:
        """`ids` find `stream` within the block; a 400 now when one of them is taken."""
        self._claim(ids, stream)
        try:
            yield
        finally:
            self._release(ids, stream)

    def tracked_events(self, ids: Sequence[str], stream: RequestsStream,
                       events: AsyncGenerator[str, None]) -> AsyncGenerator[str, None]:
        """`events` (a response streaming `stream`), with `ids` claimed from now: a 400 now,
        before the response starts, when one of them is taken."""
        self._claim(ids, stream)
        return self._tracking(ids, stream, events)

    async def _tracking(self, ids: Sequence[str], stream: RequestsStream,
                        events: AsyncGenerator[str, None]) -> AsyncGenerator[str, None]:
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    yield event
        finally:
            self._release(ids, stream)

    def abort(self, rid: str) -> None:
        """Aborts the request `rid`; an id not in flight (finished, unknown) is a no-op, as in
        SGLang."""
        if rid in self._streams:
            stream, engine_rid = self._streams[rid]
            stream.abort(engine_rid)
