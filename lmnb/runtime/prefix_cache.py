"""The prefix-cache interface (token ids -> KV slots, handles to lock) and the cache that reuses
nothing. It never sees a request: the scheduler's cache manager turns requests into calls."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterator, Sequence
from typing import Any, Protocol, TypedDict

import torch

from lmnb.runtime.memory import KVAllocator

CacheHandle = Any  # opaque to callers: pass it back to lock/unlock/note_hit


class EvictionListener(Protocol):
    """Told of evictions (a data-parallel replica's `CacheEventLog`)."""

    def evicted(self, tokens: Sequence[int]) -> None: ...  # root path through the leaf's 1st token
    def reset(self) -> None: ...


class MatchResult:
    """A matched prefix: its length, the handle to lock before using its KV slots, and the slots
    themselves, gathered from the matched nodes' runs on first use (ranking or deferring a
    request needs only the length: no device work). `host_length`: how many tokens right after
    it a tiered cache keeps in host memory (`load_back` would bring them to the device)."""

    __slots__ = ("parts", "handle", "length", "host_length", "_indices")

    def __init__(self, parts: Sequence[torch.Tensor], handle: CacheHandle, *,
                 host_length: int = 0) -> None:
        self.parts = tuple(parts)  # [n_i] KV slots of each matched run, in order
        self.handle = handle
        self.length = sum(len(part) for part in self.parts)
        self.host_length = host_length
        self._indices: torch.Tensor | None = None

    @property
    def indices(self) -> torch.Tensor:
        """[length] KV slots of the matched prefix, in order."""
        if self._indices is None:
            self._indices = (self.parts[0] if len(self.parts) == 1
                             else torch.cat(self.parts))
        return self._indices

    def __iter__(self) -> Iterator[Any]:
        """`indices, handle = match`."""
        return iter((self.indices, self.handle))


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix: slices compared in C, growing while they match and
    shrinking around the first difference (long shared prompts cost a few slice compares)."""
    n = min(len(a), len(b))
    i, step = 0, 64
    while i < n:
        j = min(i + step, n)
        if a[i:j] == b[i:j]:
            i, step = j, step * 2
        elif step > 8:
            step //= 8
        else:
            while i < j and a[i] == b[i]:
                i += 1
            return i
    return n


class CacheStats(TypedDict):
    """A prefix cache's part of `Runtime.stats()`."""

    evicted_tokens: int
    eviction_events: int
    tree_nodes: int
    tree_tokens: int  # evictable + protected
    evictable_tokens: int
    protected_tokens: int  # locked by running requests or pins


class PrefixCache(ABC):
    """KV of earlier requests kept for reuse, sharing the one slot allocator with running
    requests.

    Invariants:
    - a handle must be locked (`lock`) before the indices of its match are used, and unlocked
      exactly once when the user lets go of them; a locked slot is never evicted;
    - every slot is in exactly one place: free (in the allocator), evictable (cached, unlocked),
      protected (cached, locked), or owned by a live request beyond its matched prefix;
    - `match_prefix` returns at most `len(key) - 1` tokens: a request computes one of its own.
    """

    reuses_kv = True
    prefetches = False  # `prefetch` may read ahead (a tiered cache with a disk tier)
    evicted_tokens = 0  # counted by caches that evict
    eviction_events = 0
    eviction_listener: EvictionListener | None = None  # told of evictions, if the cache evicts

    def __init__(self, allocator: KVAllocator) -> None:
        self.allocator = allocator

    def node_count(self) -> int:
        """Entries (tree nodes) cached now; 0 for caches without a tree."""
        return 0

    def snapshot(self, preview_tokens: int = 16) -> list[dict[str, Any]]:
        """The cache's tree as plain data for observers (`RadixCache.snapshot`); empty here."""
        return []

    def stats(self) -> CacheStats:
        """This cache's part of `Runtime.stats()` (tokens and evictions)."""
        evictable, protected = self.evictable_size(), self.protected_size()
        return {"evicted_tokens": self.evicted_tokens, "eviction_events": self.eviction_events,
                "tree_nodes": self.node_count(), "tree_tokens": evictable + protected,
                "evictable_tokens": evictable, "protected_tokens": protected}

    @abstractmethod
    def match_prefix(self, key: Sequence[int], extra_key: Hashable = None) -> MatchResult:
        """Longest cached prefix of `key` under namespace `extra_key`, at most `len(key) - 1`."""

    @abstractmethod
    def match_all(self, key: Sequence[int], extra_key: Hashable = None) -> MatchResult:
        """Longest cached prefix of the whole `key` (re-matching what was just inserted)."""

    def handle_of(self, key: Sequence[int], extra_key: Hashable = None) -> CacheHandle:
        """The handle of the whole `key`, just inserted (`match_all(key).handle` without
        gathering the indices)."""
        return self.match_all(key, extra_key).handle

    @abstractmethod
    def insert(self, key: Sequence[int], indices: torch.Tensor, extra_key: Hashable = None) -> int:
        """Offers `key` -> `indices`; returns how many leading tokens were cached already. The
        cache owns `indices[returned:]` from now on (it may free them at once); the leading
        duplicates stay the caller's to free or keep."""

    def persist(self, key: Sequence[int], indices: torch.Tensor,  # noqa: B027
                extra_key: Hashable = None) -> None:
        """`key`'s KV in `indices` is computed (a finished request's, its passes' results
        read): a tier that outlives the process may copy it now. `insert` does not offer to
        such a tier: a pass's prompts are inserted when it is launched, before its KV exists,
        and a failed pass's entries are dropped only from the device and host tiers. The
        default keeps no such tier."""

    def insert_tail(self, key: Sequence[int], start: int, slots: torch.Tensor,
                    extra_key: Hashable = None) -> tuple[int, CacheHandle]:
        """Offers `key` whose first `start` tokens are cached and locked by the caller, with
        `slots` [len(key) - start] the KV slots of the rest; returns (how many leading tokens
        of `key` were cached already, >= `start`; the handle of the whole key). As with
        `insert`, the cache owns `slots` past the returned length. The cache may keep views of
        `slots`: the caller hands over a tensor nobody writes again. The default gathers the
        prefix and goes through `insert` (caches with their own `insert` rules inherit it)."""
        prefix = self.match_all(key[:start], extra_key).indices if start else slots[:0]
        already = self.insert(key, torch.cat((prefix, slots)), extra_key)
        return already, self.handle_of(key, extra_key)

    @abstractmethod
    def lock(self, handle: CacheHandle) -> None: ...

    @abstractmethod
    def unlock(self, handle: CacheHandle) -> None: ...

    def note_hit(self, handle: CacheHandle) -> None:  # noqa: B027
        """A request was admitted on the prefix ending at `handle` (for hit statistics)."""

    def shared_prefixes(self, handles: Sequence[CacheHandle],
                        min_tokens: int) -> list[tuple[int, list[int]]]:
        """Groups of requests (by position in `handles`, each the locked handle of a request's
        cached prompt) whose KV rows begin with the same cached slots: (shared length, rows),
        the deepest prefix each request shares with another, of at least `min_tokens` tokens.
        The default shares nothing."""
        return []

    def load_back(self, key: Sequence[int], extra_key: Hashable = None, *, room: int) -> int:
        """Brings KV of `key`'s prefix kept in slower tiers (host memory, disk) into device
        slots, at most `room` of them, so that `match_prefix(key)` matches it; returns how many
        tokens were loaded. The default keeps no other tier."""
        return 0

    def prefetch(self, key: Sequence[int], extra_key: Hashable = None) -> None:  # noqa: B027
        """Starts reading KV of `key`'s prefix kept in a slow tier (disk) in the background, for
        a later `load_back`; the default keeps none."""

    def prefetching(self, key: Sequence[int], extra_key: Hashable = None) -> bool:
        """Whether such a read for `key` is still running (its request had better wait)."""
        return False

    def wait_prefetch(self, key: Sequence[int], extra_key: Hashable = None) -> None:  # noqa: B027
        """Waits for the read of `key` (bounded; a read too slow is given up)."""

    def check(self) -> None:  # noqa: B027
        """Asserts the cache's own invariants (tests, `check_integrity`); the default has none."""

    def close(self) -> None:  # noqa: B027
        """Lets go of what the cache holds beyond the device pool (host memory, writer
        threads) when its runtime closes; the default holds nothing."""

    def cached_length(self, key: Sequence[int], extra_key: Hashable = None) -> int:
        """How many leading tokens of `key` are cached now, for observers (widgets): no lock,
        no split, no LRU touch. The default caches nothing."""
        return 0

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Frees up to `num_tokens` unlocked cached slots, least recently used first; returns how
        many were freed."""

    def check_locks(self, holders: Sequence[CacheHandle]) -> None:  # noqa: B027
        """Self-check for tests: every entry's lock count is the number of `holders` (handles
        locked once each: live requests', pins') whose path holds it."""

    def drop_unlocked(self) -> None:
        """Drops every unlocked entry, keeping no copy of it anywhere (its KV was never
        written: a failed pass's prompts cached at launch; or `flush_cache`)."""
        self.evict(self.evictable_size())

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    @abstractmethod
    def reset(self) -> None:
        """Drops every cached entry; only valid when no handle is locked."""


class NoReuseCache(PrefixCache):
    """Caches nothing: every request prefills its whole prompt and frees its KV when done."""

    reuses_kv = False

    def _empty(self) -> MatchResult:
        return MatchResult((torch.empty(0, dtype=torch.int64, device=self.allocator.device),),
                           None)

    def match_prefix(self, key: Sequence[int], extra_key: Hashable = None) -> MatchResult:
        return self._empty()

    def match_all(self, key: Sequence[int], extra_key: Hashable = None) -> MatchResult:
        return self._empty()

    def insert(self, key: Sequence[int], indices: torch.Tensor, extra_key: Hashable = None) -> int:
        self.allocator.free(indices.clone())
        return 0

    def handle_of(self, key: Sequence[int], extra_key: Hashable = None) -> CacheHandle:
        return None

    def lock(self, handle: CacheHandle) -> None:
        pass

    def unlock(self, handle: CacheHandle) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def reset(self) -> None:
        pass
