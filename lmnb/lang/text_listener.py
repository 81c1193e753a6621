"""`TextListener`: one `iter_text` reader of a program state, fed on the program loop."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

END = object()  # a text listener's last item
FAILED = object()  # ... when the program failed


class TextListener:
    """One `iter_text` reader: the text deltas of variable `var` (None: of the whole state), then
    `END` or `FAILED`. Filled on the loop; its one reader pops from any thread (a deque's
    appends and pops are atomic) and awaits `get` on the loop when it is empty."""

    def __init__(self, var: str | None) -> None:
        self.var = var
        self.items: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None

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

    def open(self, var: str | None, already: str, *, failed: bool,
             finished: bool) -> TextListener:
        """A reader of `var` that first gets `already` (the text so far), then the deltas; or
        at once FAILED / END when the run failed / the text is complete."""
        listener = TextListener(var)
        if already:
            listener.put(already)
        if failed:
            listener.put(FAILED)
        elif finished:
            listener.put(END)
        else:
            self._open.append(listener)
        return listener

    def close(self, listener: TextListener) -> None:
        if listener in self._open:
            self._open.remove(listener)

    def notify(self, var: str | None, delta: str) -> None:
        for listener in self._open:
            if listener.var is None or listener.var == var:
                listener.put(delta)

    def finish(self, var: str) -> None:
        """`var`'s readers get END."""
        for listener in [lst for lst in self._open if lst.var == var]:
            self._open.remove(listener)
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
