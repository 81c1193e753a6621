"""Requests' KV bookkeeping over the prefix cache, the slot allocator and the request table.

The only place that reads and writes a request's KV fields (`req_pool_idx`, `kv_len`,
`prefix_len`, `cache_handle`) and the `req_to_token` rows.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from lmnb.runtime.core import Req
from lmnb.runtime.kernels.metadata import host_int64
from lmnb.runtime.memory import KVAllocator, ReqToTokenPool
from lmnb.runtime.pins import PrefixPins
from lmnb.runtime.prefix_cache import MatchResult, PrefixCache


class IntegrityError(AssertionError):
    pass


class CacheManager:
    def __init__(self, cache: PrefixCache, allocator: KVAllocator,
                 req_to_token_pool: ReqToTokenPool, pins: PrefixPins | None = None) -> None:
        self.cache = cache
        self.pins = pins  # their locks count in `check_integrity`
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.table = req_to_token_pool.req_to_token
        # (row, matched prefix) of requests bound since the last table write: their prefix slots
        # are written together with the pass's own (`extend_all`), before any read of a row
        self._unwritten: dict[int, MatchResult] = {}

    # ---- sizes ---------------------------------------------------------------------------------
    def room(self) -> int:
        """Slots a new allocation can get: free now plus evictable."""
        return self.allocator.available() + self.cache.evictable_size()

    def has_request_slot(self) -> bool:
        return self.req_to_token_pool.available() > 0

    # ---- binding a request to its prefix -------------------------------------------------------
    @staticmethod
    def match_key(req: Req) -> Sequence[int]:
        """The ids whose cached prefix `req` may reuse: its fill ids, up to the first prompt
        position it still has to score (that position's logits must be computed)."""
        key = req.fill_ids
        needed_from = req.input_logprobs_needed_from
        # prompt positions still to score must be computed (once scored, a request prefilled
        # again after a retraction or a jump reuses its cached prompt and output)
        if req.wants_input_logprobs and needed_from < len(req.origin_input_ids):
            key = key[:max(needed_from, 1)]
        return key

    def prefetched(self, req: Req) -> bool:
        """False while a tiered cache reads `req`'s prefix from disk in the background (the
        read starts now if it had not)."""
        if not self.cache.prefetches:
            return True
        key = self.match_key(req)
        self.cache.prefetch(key, req.extra_key)
        return not self.cache.prefetching(key, req.extra_key)

    def wait_prefetch(self, req: Req) -> None:
        if self.cache.prefetches:
            self.cache.wait_prefetch(self.match_key(req), req.extra_key)

    def match(self, req: Req) -> MatchResult:
        """`req`'s cached prefix on the device."""
        return self.cache.match_prefix(self.match_key(req), req.extra_key)

    def bind(self, req: Req, match: MatchResult) -> None:
        """Gives `req` a request row holding its matched prefix, locked."""
        req.req_pool_idx = self.req_to_token_pool.alloc()
        self.cache.lock(match.handle)
        req.cache_handle = match.handle
        req.prefix_len = req.kv_len = match.length
        if match.length:
            self._unwritten[req.req_pool_idx] = match

    def unbind(self, req: Req) -> None:
        """Undoes `bind` before any slot of its own was allocated."""
        self.cache.unlock(req.cache_handle)
        self._release_row(req)

    def load_back(self, req: Req, *, room: int) -> int:
        """After `bind`: up to `room` tokens of `req`'s prefix past its match are brought back
        from a tiered cache's host memory or disk (their copies queued, `hicache/loads.py`) and
        `req` is bound to the longer prefix; returns how many tokens it gained."""
        if room <= 0:
            return 0
        key = self.match_key(req)
        if not self.cache.load_back(key, req.extra_key, room=room):
            return 0
        match = self.cache.match_prefix(key, req.extra_key)
        gained = match.length - req.prefix_len
        self.cache.lock(match.handle)
        self.cache.unlock(req.cache_handle)
        req.cache_handle = match.handle
        req.prefix_len = req.kv_len = match.length
        self._unwritten[req.req_pool_idx] = match
        return gained

    def write_bound_prefixes(self) -> None:
        """Writes the matched prefixes of the requests bound since the last call into their
        rows, with one gather of the matched runs."""
        if self._unwritten:
            self._write_runs(*self._bound_runs())

    def _bound_runs(self) -> tuple[list[int], list[int], list[int], list[torch.Tensor]]:
        """(rows, starts, lengths, slot parts) of the prefixes bound since the last write."""
        unwritten, self._unwritten = self._unwritten, {}
        return (list(unwritten), [0] * len(unwritten),
                [match.length for match in unwritten.values()],
                [part for match in unwritten.values() for part in match.parts])

    def _write_runs(self, rows: list[int], starts: list[int], lens: list[int],
                    parts: list[torch.Tensor]) -> None:
        """table[rows[i], starts[i] : starts[i] + lens[i]] = run i of the concatenated `parts`
        (runs in order). Only the runs' (row, start, length, offset) travel to the device
        (pinned, not waiting for it); the per-token indices are expanded there."""
        device, n = self.table.device, len(rows)
        if not n:
            return
        slots = parts[0] if len(parts) == 1 else torch.cat(parts)
        offsets = list(itertools.accumulate(lens, initial=0))
        total = offsets.pop()
        meta = host_int64([*rows, *starts, *offsets, *lens], pin=device.type == "cuda").to(
            device, non_blocking=True).view(4, n)
        run_of = torch.repeat_interleave(torch.arange(n, device=device), meta[3],
                                         output_size=total)
        cols = (meta[1] - meta[2])[run_of] + torch.arange(total, device=device)
        flat = meta[0][run_of] * self.table.stride(0) + cols
        self.table.view(-1)[flat] = slots

    # ---- allocation ----------------------------------------------------------------------------
    def alloc(self, n: int) -> torch.Tensor:
        short = n - self.allocator.available()
        if short > 0:
            self.cache.evict(short)
        return self.allocator.alloc(n)

    def extend_all(self, reqs: list[Req], extend_lens: list[int], slots: torch.Tensor) -> None:
        """An EXTEND pass's KV rows in one indexed write (with the prefixes bound for it):
        request i's next `extend_lens[i]` tokens have their KV in its run of `slots` (in batch
        order)."""
        rows, starts, lens, parts = self._bound_runs() if self._unwritten else ([], [], [], [])
        self._write_runs([*rows, *(req.req_pool_idx for req in reqs)],
                         [*starts, *(req.kv_len for req in reqs)], [*lens, *extend_lens],
                         [*parts, slots])
        for req, n in zip(reqs, extend_lens, strict=True):
            req.kv_len += n

    def extend_each_by_one(self, reqs: list[Req], slots: torch.Tensor, pool_indices: list[int],
                           kv_lens: list[int]) -> None:
        """Decode: request i (row `pool_indices[i]`, `kv_lens[i]` tokens of KV so far) has its
        next token's KV in `slots[i]` (one indexed write for the batch; the indices travel from
        pinned memory, so the copy does not wait for the device)."""
        self.write_bound_prefixes()
        device = self.table.device
        where = host_int64([*pool_indices, *kv_lens], pin=device.type == "cuda").to(
            device, non_blocking=True)
        n = len(reqs)
        self.table[where[:n], where[n:]] = slots
        for req in reqs:
            req.kv_len += 1

    # ---- speculative verify passes -------------------------------------------------------------
    def hold_tail(self, req: Req, kv_len: int, keep: int) -> torch.Tensor:
        """After a verify pass: `req`'s KV is cut back to its first `kv_len` tokens; of the slots
        past them the first `keep` (accepted drafts) are returned, held by the caller, who gives
        each back with `regain` or `free_slots`; the rest (rejected drafts) are freed."""
        tail = self.table[req.req_pool_idx, kv_len:req.kv_len].clone()
        self.allocator.free(tail[keep:])
        req.kv_len = kv_len
        return tail[:keep]

    def regain(self, req: Req) -> None:
        """The next held slot (still in `req`'s row, right after its KV) is the request's."""
        req.kv_len += 1

    def free_slots(self, slots: torch.Tensor) -> None:
        """Held slots no request will own."""
        self.allocator.free(slots)

    # ---- handing KV back -----------------------------------------------------------------------
    def cache_pass(self, reqs: list[Req], extend_lens: list[int], slots: torch.Tensor) -> None:
        """Once a prefill pass is launched (or run): each request's tokens so far go into the
        cache (requests of later passes hit them; the pass writes their KV before any later
        pass reads it, in stream order) and its lock moves down to them. The pass's `slots`
        (request i's run of `extend_lens[i]`, in batch order) are copied once; the cache's new
        leaves are views of the copy. A run another request of the pass cached first is read
        from the cache's slots, this request's copy freed (rare: shared runs are deferred)."""
        if not self.cache.reuses_kv:
            return
        self.write_bound_prefixes()
        frozen = slots.clone()  # the allocator's slots are views of its free list
        offset = 0
        fix_rows: list[int] = []
        fix_starts: list[int] = []
        fix_lens: list[int] = []
        fix_parts: list[torch.Tensor] = []
        for req, n in zip(reqs, extend_lens, strict=True):
            start, run = req.kv_len - n, frozen[offset:offset + n]
            offset += n
            if start != req.prefix_len:  # KV of its own before this pass (not a prompt's)
                self.cache_unfinished(req)
                continue
            key = req.fill_slice(0, req.kv_len)
            already, handle = self.cache.insert_tail(key, start, run, req.extra_key)
            if already > start:  # the row reads the cached copy of key[start:already]
                self.allocator.free(run[:already - start])
                fix_rows.append(req.req_pool_idx)
                fix_starts.append(start)
                fix_lens.append(already - start)
                fix_parts += _tail(self.cache.match_all(key[:already], req.extra_key).parts,
                                   start)
            self.cache.lock(handle)
            self.cache.unlock(req.cache_handle)
            req.cache_handle = handle
            req.prefix_len = req.kv_len
        self._write_runs(fix_rows, fix_starts, fix_lens, fix_parts)

    def cache_unfinished(self, req: Req) -> None:
        """After a prefill pass: the computed tokens go into the cache at once (requests sharing
        them can hit while this one runs) and the request's lock moves down to them."""
        if not self.cache.reuses_kv:
            return
        self.write_bound_prefixes()
        key = req.fill_slice(0, req.kv_len)
        row = self.table[req.req_pool_idx]
        already = self.cache.insert(key, row[:req.kv_len], req.extra_key)
        if already > req.prefix_len:  # cached meanwhile by another request: use those slots
            self.allocator.free(row[req.prefix_len:already].clone())
            match = self.cache.match_all(key, req.extra_key)
            row[req.prefix_len:len(match.indices)] = match.indices[req.prefix_len:]
            handle, prefix_len = match.handle, len(match.indices)
        else:  # the row's slots are what the cache now holds for `key`
            handle, prefix_len = self.cache.handle_of(key, req.extra_key), req.kv_len
        self.cache.lock(handle)
        self.cache.unlock(req.cache_handle)
        req.cache_handle = handle
        req.prefix_len = prefix_len

    def cache_finished(self, req: Req) -> None:
        """A request that is done (finished, retracted or jumping) hands its KV to the cache."""
        self.write_bound_prefixes()
        slots = self.table[req.req_pool_idx, :req.kv_len]
        key = req.fill_slice(0, req.kv_len)
        already = self.cache.insert(key, slots, req.extra_key)
        self.cache.persist(key, slots, req.extra_key)  # its passes' results were read
        if already > req.prefix_len:  # a copy: the row is reused by the next request
            self.allocator.free(slots[req.prefix_len:already].clone())
        self.cache.unlock(req.cache_handle)
        self._release_row(req)

    def drop_unlocked(self) -> None:
        """Drops every unlocked cached entry, copies in lower tiers too (after a failed prefill
        pass whose prompts were cached at launch: their KV was never written)."""
        self.cache.drop_unlocked()

    def free(self, req: Req) -> None:
        """An aborted request: its own KV is freed, its prefix unlocked."""
        self.allocator.free(self.table[req.req_pool_idx, req.prefix_len:req.kv_len].clone())
        self.cache.unlock(req.cache_handle)
        self._release_row(req)

    def _release_row(self, req: Req) -> None:
        self._unwritten.pop(req.req_pool_idx, None)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.cache_handle = None
        req.prefix_len = req.kv_len = 0

    # ---- accounting ----------------------------------------------------------------------------
    def check_integrity(self, live: list[Req], waiting: list[Req]) -> None:
        """KV slots are conserved: free + evictable + protected + owned by requests == total;
        the cache's own invariants hold (`PrefixCache.check`), and its locks are those of the
        live requests and the pins (a leaked lock keeps slots from eviction for good)."""
        holders = [req.cache_handle for req in live]
        holders += self.pins.handles() if self.pins is not None else []
        try:
            self.cache.check()
            self.cache.check_locks(holders)
        except AssertionError as error:
            raise IntegrityError(f"prefix cache: {error}") from error
        owned = sum(req.owned_kv_len for req in live)
        free = self.allocator.available()
        evictable = self.cache.evictable_size()
        protected = self.cache.protected_size()
        total = self.allocator.size
        if free + evictable + protected + owned != total:
            raise IntegrityError(
                f"KV slots leaked: free {free} + evictable {evictable} + protected {protected} + "
                f"owned {owned} != total {total}")
        used_rows = self.req_to_token_pool.size - self.req_to_token_pool.available()
        if used_rows != len(live):
            raise IntegrityError(f"request slots leaked: {used_rows} in use, {len(live)} live")
        if any(req.req_pool_idx is not None for req in waiting):
            raise IntegrityError("a waiting request still holds KV")


def _tail(parts: tuple[torch.Tensor, ...], start: int) -> list[torch.Tensor]:
    """Views of the runs `parts` (in order) past their first `start` slots."""
    out = []
    for part in parts:
        if start >= len(part):
            start -= len(part)
            continue
        out.append(part[start:])
        start = 0
    return out
