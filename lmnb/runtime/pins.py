"""Pinned prefixes: cached token runs that eviction skips until they are unpinned.

A pin is a lock on the prefix cache's node where the run ends, held by no request: like a running
request's lock, it protects the whole path from the root, so `evict` never frees those slots
(the cache's `lock_ref > 0` rule). Every method runs on the scheduler thread (the engine calls in
through `SchedulerThread.call`), as every other access to the cache does.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lmnb.runtime.prefix_cache import CacheHandle, PrefixCache


@dataclass(frozen=True)
class Pin:
    handle: Any  # the cache handle that is locked
    tokens: int


class PrefixPins:
    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache
        self._pins: dict[int, Pin] = {}
        self._ids = itertools.count(1)

    def pin(self, input_ids: Sequence[int]) -> int | None:
        """Locks the cached run `input_ids`; its pin id, or None when the cache does not hold
        all of it (evicted since it was cached: the caller caches it again and retries)."""
        match = self.cache.match_all(list(input_ids))
        if match.length < len(input_ids):
            return None
        self.cache.lock(match.handle)
        pin_id = next(self._ids)
        self._pins[pin_id] = Pin(match.handle, len(input_ids))
        return pin_id

    def handles(self) -> list[CacheHandle]:
        """The handles the pins hold locked (one lock each)."""
        return [pin.handle for pin in self._pins.values()]

    def unpin(self, pin_id: int) -> bool:
        """Releases pin `pin_id` (its tokens become evictable like any cached ones); False if no
        such pin is held."""
        pin = self._pins.pop(pin_id, None)
        if pin is None:
            return False
        self.cache.unlock(pin.handle)
        return True

    def __len__(self) -> int:
        return len(self._pins)

    def tokens(self) -> int:
        """Tokens held by the pins (a run pinned twice counts twice)."""
        return sum(pin.tokens for pin in self._pins.values())

    def stats(self) -> dict[str, int]:
        """`pinned_prefixes` and the tokens they hold (`pinned_tokens`)."""
        return {"pinned_prefixes": len(self._pins), "pinned_tokens": self.tokens()}
