"""`CacheEventLog`: a replica's prefix-cache evictions, numbered, for a data-parallel router to
poll (`Runtime.cache_events(since)`), so that its meta tree forgets what the replica forgot.

An eviction event names the evicted edge by the path that leads to it: the tokens from the root
through the first token of the evicted leaf (`tokens`, with the leaf starting at `start =
len(tokens) - 1`). That leaf had no children, so after it the replica holds nothing that begins
with `tokens`. A `reset` event (flush) drops everything. The log is bounded by tokens held; a
reader that fell behind its oldest event gets `complete: False` and must forget the replica's
whole cache (an honest, if pessimistic, recovery).
"""

from __future__ import annotations

import threading
from array import array
from collections import deque
from collections.abc import Sequence
from typing import Any

DEFAULT_MAX_TOKENS = 1 << 20  # ~4 MiB of token ids held for readers that have not polled yet


class CacheEventLog:
    """Thread-safe: the scheduler thread appends, any thread reads."""

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self.max_tokens = max_tokens
        self._lock = threading.Lock()
        self._events: deque[tuple[int, str, array | None]] = deque()
        self._tokens = 0
        self._seq = 0  # number of the latest event; the first is 1
        self._dropped_upto = 0  # events numbered <= this were dropped for room

    def evicted(self, tokens: Sequence[int]) -> None:
        """The leaf whose path is `tokens` (root through its first token) was evicted."""
        self._append("evict", array("q", tokens))

    def reset(self) -> None:
        """The whole cache was emptied."""
        self._append("reset", None)

    def _append(self, kind: str, tokens: array | None) -> None:
        with self._lock:
            self._seq += 1
            if kind == "reset":  # nothing before a reset matters to a reader any more
                self._events.clear()
                self._tokens = 0
            self._events.append((self._seq, kind, tokens))
            self._tokens += len(tokens) if tokens is not None else 0
            while self._tokens > self.max_tokens and len(self._events) > 1:
                seq, _, old = self._events.popleft()
                self._tokens -= len(old) if old is not None else 0
                self._dropped_upto = seq

    def since(self, seq: int = 0) -> dict[str, Any]:
        """Events numbered after `seq`, as JSON-able data: `{"seq": latest, "complete": bool,
        "events": [{"seq", "type": "evict"|"reset", "tokens"?}]}`. `complete` is False when
        some event after `seq` was dropped (or `seq` is from another log)."""
        with self._lock:
            latest = self._seq
            events = [e for e in self._events if e[0] > seq]
            complete = seq <= latest and (seq >= self._dropped_upto
                                          or any(kind == "reset" and s > seq
                                                 for s, kind, _ in events))
        out = []
        for number, kind, tokens in events:
            event: dict[str, Any] = {"seq": number, "type": kind}
            if tokens is not None:
                event["tokens"] = tokens.tolist()
            out.append(event)
        return {"seq": latest, "complete": complete, "events": out}
