"""The prefix-cache interface the scheduler talks to, and the implementation that reuses nothing."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import torch

from lmnb.runtime.core import Req
from lmnb.runtime.memory import ReqToTokenPool, TokenToKVPool


class MatchResult(NamedTuple):
    indices: torch.Tensor  # KV slots of the matched prefix, in order
    last_node: Any  # handle to lock while the slots are in use


_CHUNK = 64


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i + _CHUNK <= n and a[i:i + _CHUNK] == b[i:i + _CHUNK]:  # slice compares run in C
        i += _CHUNK
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache(ABC):
    """KV of earlier requests kept for reuse, sharing the one token pool with running requests.

    Invariants: handles must be locked (`inc_lock_ref`) before the returned indices are used and
    unlocked when the request lets go of them; a locked slot is never evicted. Every slot is in
    exactly one place: free, evictable (cached, unlocked), protected (cached, locked), or owned by
    a live request beyond its matched prefix.
    """

    reuses_kv = True

    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: TokenToKVPool) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool

    @abstractmethod
    def match_prefix(self, key: Sequence[int], extra_key: Hashable = None) -> MatchResult:
        """Longest cached prefix of `key`, at most `len(key) - 1` tokens (a request always computes
        at least one token of its own)."""

    @abstractmethod
    def cache_finished_req(self, req: Req) -> None:
        """Takes over the slots `req_to_token[req.req_pool_idx, :req.kv_len]` of a request that is
        done (finished or retracted): keeps them for reuse or frees them, and unlocks
        `req.last_node`."""

    @abstractmethod
    def cache_unfinished_req(self, req: Req) -> None:
        """After a prefill chunk: may cache the computed part and move the request's lock to it,
        updating `req.prefix_indices` and `req.last_node`."""

    def note_hit(self, node: Any) -> None:  # noqa: B027
        """A request was admitted on the prefix ending at `node` (for hit statistics)."""

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> None: ...

    @abstractmethod
    def dec_lock_ref(self, node: Any) -> None: ...

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Frees up to `num_tokens` unlocked cached slots; returns how many were freed."""

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    @abstractmethod
    def reset(self) -> None:
        """Drops every cached entry; only valid when no request holds a lock."""


class NoReuseCache(PrefixCache):
    """Caches nothing: every request prefills its whole prompt and frees its KV when done."""

    reuses_kv = False

    _EMPTY = torch.empty(0, dtype=torch.int64)

    def match_prefix(self, key: Sequence[int], extra_key: Hashable = None) -> MatchResult:
        return MatchResult(self._EMPTY.to(self.token_to_kv_pool.device), None)

    def cache_finished_req(self, req: Req) -> None:
        slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, :req.kv_len]
        self.token_to_kv_pool.free(slots.clone())

    def cache_unfinished_req(self, req: Req) -> None:
        pass

    def inc_lock_ref(self, node: Any) -> None:
        pass

    def dec_lock_ref(self, node: Any) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def reset(self) -> None:
        pass
