"""`TextListener`: one `iter_text` reader of a program state, fed on the program loop."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

END = object()  # a text listener's last item
FAILED = object()  # ... when the program failed


class TextListener:
    """One `iter_text` reader: the text deltas of variable `var` (None: of the whole state), then
    `END` or `FAILED`. With `with_meta`, each delta comes as `(delta, meta_info)`: the variable's
    meta info as it stood when the delta came, and the final meta info with the last pair (an
    extra `("", meta_info)` when it differs from the last delta's). Filled on the loop; its one
    reader pops from any thread (a deque's appends and pops are atomic) and awaits `get` on the
    loop when it is empty."""

    def __init__(self, var: str | None, *, with_meta: bool = False) -> None:
        self.var = var
        self.with_meta = with_meta
        self.items: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._last_meta: Any = None  # with_meta: the meta info of the last pair put

    def put_text(self, delta: str, meta: dict[str, Any] | None) -> None:
        if not self.with_meta:
            self.put(delta)
            return
        self._last_meta = meta = {} if meta is None else meta
        self.put((delta, meta))

    def put_final_meta(self, meta: dict[str, Any] | None) -> None:
        """The variable is final with `meta`: with `with_meta`, `("", meta)` unless the last
        pair had it."""
        if self.with_meta and meta is not None and meta != self._last_meta:
            self.put_text("", meta)

    def put(self, item: Any) -> None:
        self.items.append(item)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> Any:
        while not self.items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self.items.popleft()


class TextListeners:
    """The open `iter_text` readers of one executor, on its program loop: fed each text delta,
    ended when their variable finishes or the run goes idle, failed with it."""

    def __init__(self) -> None:
        self._open: list[TextListener] = []

    def __bool__(self) -> bool:
        return bool(self._open)

    def open(self, var: str | None, already: str, *, failed: bool, finished: bool,
             with_meta: bool = False, meta: dict[str, Any] | None = None) -> TextListener:
        """A reader of `var` that first gets `already` (the text so far, with `meta`, the meta
        info so far), then the deltas; or at once FAILED / END when the run failed / the text is
        complete."""
        listener = TextListener(var, with_meta=with_meta)
        if already:
            listener.put_text(already, meta)
        if failed:
            listener.put(FAILED)
        elif finished:
            listener.put_final_meta(meta)
            listener.put(END)
        else:
            self._open.append(listener)
        return listener

    def close(self, listener: TextListener) -> None:
        if listener in self._open:
            self._open.remove(listener)

    def notify(self, var: str | None, delta: str, meta: dict[str, Any] | None = None) -> None:
        """`delta` of `var`'s text (None: text of no variable), `meta` its meta info so far."""
        for listener in self._open:
            if listener.var is None or listener.var == var:
                listener.put_text(delta, meta)

    def finish(self, var: str, meta: dict[str, Any] | None = None) -> None:
        """`var`'s readers get its final `meta` info (those that take it) and END."""
        for listener in [lst for lst in self._open if lst.var == var]:
            self._open.remove(listener)
            listener.put_final_meta(meta)
            listener.put(END)

    def end_all(self, item: object = END) -> None:
        """Every reader gets `item` (END: the run is idle; FAILED: it failed)."""
        listeners, self._open = self._open, []
        for listener in listeners:
            listener.put(item)


def delivered(item: Any, raise_error: Any) -> bool:
    """Whether a reader's `item` is text to yield: False at END; FAILED calls `raise_error`."""
    if item is END:
        return False
    if item is FAILED:
        raise_error()
    return True
