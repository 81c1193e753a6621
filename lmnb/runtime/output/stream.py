"""`OutputStream`: the chunks of one generate call (one or several requests), consumable by a
thread or by an asyncio task."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

from lmnb.runtime.output.loop_waker import LoopWaker, loop_waker, wake

Chunk = dict[str, Any]

_EMPTY = object()
_END = object()


def extend_output_ids(ids: list[int], chunk: Chunk) -> None:
    """Adds a chunk's `output_ids` to its request's `ids` so far: at the end, or from
    `meta_info["output_ids_from"]` on, where a jump-forward re-tokenized the tail."""
    del ids[chunk["meta_info"].get("output_ids_from", len(ids)):]
    ids.extend(chunk["output_ids"])


class OutputStream:
    """Chunks `{"text", "output_ids", "meta_info"}` (plus `"index"` when `tagged`) of the requests
    `rids`, in arrival order; each request's last chunk has `meta_info["finish_reason"]` set, and
    every chunk's `meta_info["completion_tokens"]` counts its request's output ids so far.

    The output thread calls `deliver`/`fail`. One consumer at a time: a thread (`get`, `for chunk
    in stream`, `results()`) or an asyncio task (`async for`, `await aresults()`). `incremental`
    streams get a chunk per step with what is new; the others one whole chunk per request at its
    end. Iteration ends after the last request's last chunk. Closing earlier (`close()`, leaving a
    `with` block or a `for` loop, cancelling the awaiting task) calls `on_close(unfinished rids)`
    once: the engine aborts them. `poll` runs on each idle wait of a thread consumer (every
    `poll_interval` s, so Ctrl-C lands and a dead runtime can raise).
    """

    def __init__(self, rids: Sequence[int], *, incremental: bool = True, tagged: bool = False,
                 on_close: Callable[[list[int]], None] | None = None,
                 poll: Callable[[], None] | None = None, poll_interval: float = 0.1) -> None:
        self.rids = tuple(rids)
        self.index = {rid: i for i, rid in enumerate(self.rids)}
        self._by_id = {str(rid): rid for rid in self.rids}  # meta_info["id"] -> rid
        self.incremental = incremental
        self.tagged = tagged
        self.poll_interval = poll_interval
        self._on_close = on_close
        self._poll = poll
        self._cond = threading.Condition()
        self._chunks: deque[Chunk] = deque()
        self._delivered_final: set[int] = set()  # producer side
        self._remaining = len(self.rids)  # consumer side: last chunks not yet taken
        self._error: BaseException | None = None
        self._closed = False
        self._waiter: tuple[LoopWaker, asyncio.Future] | None = None
        self._iterator: Iterator[Chunk] | None = None

    # ---- producer (output thread) ------------------------------------------------------------
    def deliver(self, chunks: Sequence[Chunk]) -> None:
        """Appends chunks and wakes the consumer; dropped once the stream is closed."""
        with self._cond:
            if self._closed:
                return
            for chunk in chunks:
                if chunk["meta_info"].get("finish_reason") is not None:
                    self._delivered_final.add(self._by_id[chunk["meta_info"]["id"]])
            self._chunks.extend(chunks)
            self._cond.notify_all()
            waiter, self._waiter = self._waiter, None
        self._wake(waiter)

    def fail(self, error: BaseException) -> None:
        """The consumer raises `error` once the chunks already delivered are taken."""
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()
            waiter, self._waiter = self._waiter, None
        self._wake(waiter)

    @staticmethod
    def _wake(waiter: tuple[LoopWaker, asyncio.Future] | None) -> None:
        if waiter is not None:
            wake(*waiter)

    # ---- consumer ------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def finished(self) -> bool:
        """Every request's last chunk was delivered (not necessarily taken)."""
        return len(self._delivered_final) == len(self.rids)

    def close(self) -> None:
        """Stops delivery; requests whose last chunk has not arrived go to `on_close`."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            unfinished = [rid for rid in self.rids if rid not in self._delivered_final]
            self._cond.notify_all()
            waiter, self._waiter = self._waiter, None
        self._wake(waiter)
        if unfinished and self._on_close is not None:
            self._on_close(unfinished)

    def abort(self, rid: int) -> None:
        """Aborts one request of the stream (if unfinished): the engine ends it, and its last
        chunk, finish_reason `abort`, still arrives; the others go on."""
        if rid not in self.index:
            raise ValueError(f"request {rid!r} is not one of the stream's {self.rids}")
        with self._cond:
            unfinished = not self._closed and rid not in self._delivered_final
        if unfinished and self._on_close is not None:
            self._on_close([rid])

    def _take(self) -> Any:
        """Under the lock: the next chunk, `_END`, or `_EMPTY`; raises a delivered error."""
        if self._chunks:
            chunk = self._chunks.popleft()
            if chunk["meta_info"].get("finish_reason") is not None:
                self._remaining -= 1
            return chunk
        if self._error is not None:
            raise self._error
        if self._remaining == 0 or self._closed:
            return _END
        return _EMPTY

    def get(self, timeout: float | None = None) -> Chunk | None:
        """The next chunk, or None when the stream is over; `queue.Empty` after `timeout` s."""
        with self._cond:
            item = self._take()
            if item is _EMPTY:
                self._cond.wait(timeout)
                item = self._take()
        if item is _EMPTY:
            raise queue.Empty
        return None if item is _END else item

    def __iter__(self) -> Iterator[Chunk]:
        try:
            while True:
                try:
                    chunk = self.get(self.poll_interval)
                except queue.Empty:
                    if self._poll is not None:
                        self._poll()
                    continue
                if chunk is None:
                    return
                yield chunk
        finally:
            self.close()

    def __next__(self) -> Chunk:
        """`next(stream)` as on a generator (one iterator kept across calls)."""
        if self._iterator is None:
            self._iterator = iter(self)
        return next(self._iterator)

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self

    async def __anext__(self) -> Chunk:
        while True:
            with self._cond:
                item = self._take()
                if item is _EMPTY:
                    loop = asyncio.get_running_loop()
                    future = loop.create_future()
                    self._waiter = (loop_waker(loop), future)
            if item is _END:
                self.close()
                raise StopAsyncIteration
            if item is not _EMPTY:
                return item
            try:
                await future
            except asyncio.CancelledError:
                self.close()
                raise

    def results(self) -> list[Chunk]:
        """Blocks until every request ends; one whole result per request, in `rids` order
        (texts concatenated, ids placed by `extend_output_ids`)."""
        return self.merge(list(self))

    async def aresults(self) -> list[Chunk]:
        try:
            return self.merge([chunk async for chunk in self])
        finally:
            self.close()

    def merge(self, chunks: list[Chunk]) -> list[Chunk]:
        """One whole result per request of this stream's `chunks`, in `rids` order."""
        texts: list[list[str]] = [[] for _ in self.rids]
        ids: list[list[int]] = [[] for _ in self.rids]
        metas: list[dict[str, Any]] = [{} for _ in self.rids]
        for chunk in chunks:
            i = self.index[self._by_id[chunk["meta_info"]["id"]]]
            texts[i].append(chunk["text"])
            extend_output_ids(ids[i], chunk)
            metas[i] = chunk["meta_info"]
        return [{"text": "".join(t), "output_ids": o, "meta_info": m}
                for t, o, m in zip(texts, ids, metas, strict=True)]

    def __enter__(self) -> OutputStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> OutputStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()
