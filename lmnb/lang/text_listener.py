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
