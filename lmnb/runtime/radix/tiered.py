"""RadixCache with a host tier (and an optional disk tier, `hicache/`): `enable_hierarchical_cache`.

A node's KV lives on the device (`value`), in the host pool (`host`), or both:

    root ── A (device+host) ──┬── B (device)          device nodes: a subtree holding the root
                              └── C (host) ── D (host) host-only nodes hang below them

Device eviction (LRU, unlocked device leaves) saves a node's KV to the host pool (unless it has
a copy there already: `write_through` copies on insert) and keeps the node in the tree; the host
pool evicts its own least recently used host-only leaves, which leave the tree. `load_back`
(before a request's prefix is matched) gives the host-only nodes on the request's path freshly
allocated device slots and queues their copies (`hicache/loads.py`: issued when the forward
starts, waited for layer by layer), then continues the prefix with the disk pages read ahead
for it when the request arrived (`hicache/prefetch.py`, an I/O thread): the scheduler thread
never reads the disk. Saves (eviction, `write_through`) run on their own stream; an eviction
waits only for the saves of the rows it frees (tickets), and settles the queued loads first
when it frees rows one of them writes.

Invariants (`check`): every node is on the device or on the host; a device node's parent is on
the device (or the root); a locked node is on the device; host slots are conserved.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from lmnb.runtime.hicache.disk import DiskTier
from lmnb.runtime.hicache.host_pool import HostKVPool
from lmnb.runtime.hicache.prefetch import DiskPrefetcher
from lmnb.runtime.memory import KVAllocator
from lmnb.runtime.prefix_cache import CacheStats, MatchResult, PrefixCache
from lmnb.runtime.radix.cache import RadixCache, TreeNode


class TieredCacheStats(CacheStats, total=False):
    """`CacheStats` plus each tier's tokens and hits (the disk's only with a disk tier)."""

    hicache_device_tokens: int  # on the device (some also on the host)
    hicache_host_tokens: int  # in the host pool (some also on the device)
    hicache_host_only_tokens: int
    hicache_host_capacity: int
    hicache_host_loaded_tokens: int  # hits brought back from the host pool
    hicache_host_saved_tokens: int
    hicache_host_evicted_tokens: int
    hicache_disk_loaded_tokens: int  # hits read from disk pages
    hicache_loads: int  # passes whose host -> device copies overlapped their forward
    hicache_load_seconds: float  # the copies' span (CUDA; CPU: copy time)
    hicache_load_wait_seconds: float  # of which the forward waited for (not overlapped)
    hicache_save_fence_waits: int  # evictions that waited for a save of the rows they free
    hicache_prefetch_reads: int  # disk reads started ahead of their request's admission
    hicache_prefetch_wait_seconds: float  # the idle scheduler waiting for such reads
    hicache_disk_bytes: int
    hicache_disk_written_pages: int
    hicache_disk_loaded_pages: int
    hicache_disk_corrupt_pages: int
    hicache_disk_removed_pages: int


def _tier(node: TreeNode) -> str:
    if node.value is not None:
        return "device+host" if node.host is not None else "device"
    return "host"


class TieredRadixCache(RadixCache):
    insert_tail = PrefixCache.insert_tail  # through `insert`: host-only nodes take the slots

    def __init__(self, allocator: KVAllocator, host: HostKVPool, *, write_through: bool,
                 disk: DiskTier | None = None) -> None:
        self.host_pool = host
        self.write_through = write_through
        self.disk = disk
        self.prefetcher = None if disk is None else DiskPrefetcher(disk, max_tokens=host.size)
        self.prefetches = self.prefetcher is not None
        self._loading: set[TreeNode] = set()  # host copies a load is about to read
        self._pending: set[TreeNode] = set()  # device rows a queued load has yet to write
        self._saves: dict[TreeNode, int] = {}  # save tickets of device rows saves may still read
        self._back_up = True  # False while `reset` drops everything
        self.host_loaded_tokens = 0  # prefix tokens brought back from the host pool
        self.host_saved_tokens = 0
        self.host_evicted_tokens = 0
        self.disk_loaded_tokens = 0
        super().__init__(allocator)

    def reset(self) -> None:
        self._settle()
        self._saves.clear()
        for node in self._nodes():
            node.host = None
        self.host_pool.allocator.clear()
        self._back_up = False
        try:
            super().reset()
        finally:
            self._back_up = True

    # ---- matching --------------------------------------------------------------------------------
    def match_prefix(self, key: Sequence[int], extra_key: Hashable = None) -> MatchResult:
        """As RadixCache.match_prefix, with the host-only run that continues the device match
        counted in `host_length` (no split, no LRU touch)."""
        match = super().match_prefix(key, extra_key)
        for child, matched in self._edges(match.handle, key[:len(key) - 1], match.length,
                                          extra_key):
            if child.value is not None:  # (a device child: its match ended)
                break
            match.host_length += matched
        return match

    # ---- loading back --------------------------------------------------------------------------
    def load_back(self, key: Sequence[int], extra_key: Hashable = None, *, room: int) -> int:
        """Brings the lower tiers' KV of `key`'s prefix (as `match_prefix` would match it) into
        device slots, at most `room` tokens; returns how many tokens were loaded."""
        if len(key) <= 1 or room <= 0:
            return 0
        key = list(key[:len(key) - 1])
        anchor, on_host = self._host_path(key, extra_key)
        loaded = self._load_host(anchor, on_host, room)
        if self.prefetcher is None or extra_key is not None or loaded < sum(
                len(n.key) for n in on_host):
            return loaded
        return loaded + self._load_staged(key, room - loaded)

    def _host_path(self, key: list[int], extra_key: Hashable) -> tuple[TreeNode, list[TreeNode]]:
        """(last device node, the host-only nodes after it) along `key`."""
        anchor, on_host = self.root, []
        for child, matched in self._edges(self.root, key, 0, extra_key):
            if matched < len(child.key):
                if child.value is not None:
                    break
                child = self._split(child, matched)  # load only what the key needs
            if child.value is None:
                on_host.append(child)
            else:
                anchor = child
        return anchor, on_host

    def _budget(self, room: int) -> int:
        """Slots a load may take now: `room`, and no more than free plus evictable."""
        return min(room, self.allocator.available() + self._evictable)

    def _load_host(self, anchor: TreeNode, on_host: list[TreeNode], room: int) -> int:
        if not on_host:
            return 0
        self.lock(anchor)  # the path's device part stays while others are evicted for room
        try:
            budget = self._budget(room)
            take, total = [], 0
            for node in on_host:
                if total + len(node.key) > budget:
                    if budget > total:  # the part that fits
                        take.append(self._split(node, budget - total))
                        total = budget
                    break
                take.append(node)
                total += len(node.key)
            if not take:
                return 0
            self._loading.update(take)
            try:
                slots = self._alloc(total)
            finally:
                self._loading.difference_update(take)
        finally:
            self.unlock(anchor)
        if slots is None:
            return 0
        try:
            self.host_pool.load(torch.cat([node.host for node in take]), slots)  # queued
        except BaseException:
            self.allocator.free(slots)  # nothing was queued: the nodes stay host-only
            raise
        offset = 0
        now = time.monotonic()
        for node in take:
            node.value = slots[offset:offset + len(node.key)]
            node.last_access = now
            offset += len(node.key)
        self._pending.update(take)
        self._evictable += total
        self.host_loaded_tokens += total
        return total

    def _load_staged(self, key: list[int], room: int) -> int:
        """Continues the device prefix of `key` with the disk pages read ahead for it."""
        assert self.prefetcher is not None
        prefix = self._match(list(key), None)
        start = len(prefix.indices)
        if start >= len(key):
            return 0
        data = self.prefetcher.take(key, start)
        if data is None:
            return 0
        self.lock(prefix.handle)
        try:
            n = min(data.shape[2], len(key) - start, self._budget(room))
            slots = self._alloc(n) if n > 0 else None
        finally:
            self.unlock(prefix.handle)
        if slots is None:
            return 0
        try:
            self.host_pool.loads.add(lambda layer: [(data[0, layer, :n], data[1, layer, :n])],
                                     slots)
        except BaseException:
            self.allocator.free(slots)
            raise
        already = self.insert(key[:start + n], torch.cat((prefix.indices, slots)))
        if already > start:  # duplicates stay ours (none expected): their load lands first
            self._settle()
            self.allocator.free(slots[:already - start])
        self._pending.add(self._descend(key[:start + n], None)[0])
        self.disk_loaded_tokens += n
        return n

    # ---- reading ahead (disk) ------------------------------------------------------------------
    def prefetch(self, key: Sequence[int], extra_key: Hashable = None) -> None:
        """Starts reading the disk pages of `key`'s prefix that continue the tree (I/O thread)."""
        if self.prefetcher is None or extra_key is not None or len(key) <= 1:
            return
        key = list(key[:len(key) - 1])  # as `match_prefix` and `load_back` see it
        if not self.prefetcher.known(key):
            self.prefetcher.start(key, self.cached_length(key))

    def prefetching(self, key: Sequence[int], extra_key: Hashable = None) -> bool:
        if self.prefetcher is None or extra_key is not None or len(key) <= 1:
            return False
        return self.prefetcher.running(list(key[:len(key) - 1]))

    def wait_prefetch(self, key: Sequence[int], extra_key: Hashable = None) -> None:
        if self.prefetcher is not None and extra_key is None and len(key) > 1:
            self.prefetcher.wait(list(key[:len(key) - 1]))

    def _alloc(self, n: int) -> torch.Tensor | None:
        short = n - self.allocator.available()
        if short > 0:
            self.evict(short)
        if self.allocator.available() < n:
            return None
        return self.allocator.alloc(n)

    # ---- inserting -------------------------------------------------------------------------------
    def persist(self, key: Sequence[int], indices: torch.Tensor,
                extra_key: Hashable = None) -> None:
        """The full pages of `key` go to the disk tier (rows gathered now)."""
        if self.disk is not None and extra_key is None:
            self.disk.offer(key, indices)

    def _inserted(self, node: TreeNode, done: int, value: torch.Tensor,
                  leaf: TreeNode | None) -> int:
        """Host-only nodes on the path take the caller's slots (they are device nodes again);
        the cached length returned counts device tokens only."""
        cached = done
        while node is not self.root and node.value is None:  # host-only: a suffix of the path
            cached -= len(node.key)
            node.value = value[cached:cached + len(node.key)].clone()
            self._evictable += len(node.key)
            node = node.parent
        if leaf is not None and self.write_through:
            self._save(leaf)
        return cached

    # ---- eviction --------------------------------------------------------------------------------
    def _device_leaf(self, node: TreeNode) -> bool:
        return (node is not self.root and node.value is not None and node.lock_ref == 0
                and all(child.value is None for child in node.children.values()))

    def evict(self, num_tokens: int) -> int:
        """Frees device slots of least recently used unlocked device leaves; their KV goes to
        the host pool (kept in the tree) or, when the pool has no room, is dropped with what
        hangs below."""
        if not self.host_pool.loads.busy:
            self._pending.clear()
        leaves = [n for n in self._nodes() if self._device_leaf(n)]
        heapq.heapify(leaves)
        freed = ticket = 0
        while freed < num_tokens and leaves:
            node = heapq.heappop(leaves)
            if node in self._pending and self.host_pool.loads.busy:
                self._settle()  # its rows may be written by a queued load: not reused before
            if node.host is None and self._back_up:
                self._save(node)
            ticket = max(ticket, self._saves.pop(node, 0))
            self.allocator.free(node.value)
            node.value = None
            self._pending.discard(node)  # (its load, if any, was settled above or is done)
            freed += len(node.key)
            self._evictable -= len(node.key)
            self.eviction_events += 1
            parent = node.parent
            if node.host is None:
                self._remove(node)
            if self._device_leaf(parent):
                heapq.heappush(leaves, parent)
        self.evicted_tokens += freed
        if ticket:
            self.host_pool.fence(ticket)  # freed rows that were saved are not overwritten too soon
        return freed

    def _settle(self) -> None:
        """Every queued load is complete for the compute stream (CPU: done)."""
        self.host_pool.loads.settle()
        self._pending.clear()

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        upper = super()._split(node, at)
        if node in self._pending:
            self._pending.add(upper)
        if node in self._saves:
            self._saves[upper] = self._saves[node]
        return upper

    def _save(self, node: TreeNode) -> None:
        """Copies `node`'s device KV into the host pool if it has room (made by evicting the
        pool's least recently used host-only leaves)."""
        n = len(node.key)
        pool = self.host_pool
        if n > pool.size:
            return
        if pool.available() < n:
            self._evict_host(n - pool.available())
        if pool.available() < n:
            return
        node.host = pool.allocator.alloc(n)
        self._saves[node] = pool.save(node.value, node.host)
        self.host_saved_tokens += n
        if len(self._saves) > 4096:  # drop the tickets of saves known to be done
            done = pool.done_ticket()
            self._saves = {kept: t for kept, t in self._saves.items() if t > done}

    def _host_leaf(self, node: TreeNode) -> bool:
        return (node.value is None and node.host is not None and not node.children
                and node not in self._loading)

    def _evict_host(self, num_tokens: int) -> int:
        leaves = [n for n in self._nodes() if self._host_leaf(n)]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            node = heapq.heappop(leaves)
            freed += len(node.key)
            parent = node.parent
            self._remove(node)
            if parent is not self.root and self._host_leaf(parent):
                heapq.heappush(leaves, parent)
        if freed < num_tokens:  # then host copies of device nodes: nothing is lost with them
            copies = sorted(n for n in self._nodes() if n.value is not None and n.host is not None)
            for node in copies:
                if freed >= num_tokens:
                    break
                self.host_pool.allocator.free(node.host)
                node.host = None
                freed += len(node.key)
        self.host_evicted_tokens += freed
        return freed

    def _remove(self, node: TreeNode) -> None:
        """Takes `node` (off the device) and the host-only nodes below it out of the tree."""
        stack = [node]
        while stack:
            current = stack.pop()
            assert current.value is None and current.lock_ref == 0, current.id
            if current.host is not None:
                self.host_pool.allocator.free(current.host)
                current.host = None
            stack.extend(current.children.values())
        parent = node.parent
        del parent.children[(node.namespace, node.key[0])]
        if self.eviction_listener is not None and node.namespace is None:
            self.eviction_listener.evicted(self._path(parent) + node.key[:1])

    def drop_unlocked(self) -> None:
        """Evicts every unlocked device entry without saving it, then drops the host pool's
        entries (host-only nodes, host copies of device nodes): a write-through or an earlier
        eviction may hold a copy of KV that was never written. The disk holds none: only
        `persist` (computed KV) offers to it."""
        self._back_up = False
        try:
            self.evict(self.evictable_size())
        finally:
            self._back_up = True
        self._evict_host(self.host_pool.size)

    # ---- inspection ------------------------------------------------------------------------------
    def host_size(self) -> int:
        return self.host_pool.size - self.host_pool.available()

    def stats(self) -> TieredCacheStats:
        device_only = host_only = both = 0
        for node in self._nodes():
            tier = _tier(node)
            if tier == "device":
                device_only += len(node.key)
            elif tier == "host":
                host_only += len(node.key)
            else:
                both += len(node.key)
        stats: TieredCacheStats = {
            **super().stats(),
            "hicache_device_tokens": device_only + both,
            "hicache_host_tokens": host_only + both, "hicache_host_only_tokens": host_only,
            "hicache_host_capacity": self.host_pool.size,
            "hicache_host_loaded_tokens": self.host_loaded_tokens,
            "hicache_host_saved_tokens": self.host_saved_tokens,
            "hicache_host_evicted_tokens": self.host_evicted_tokens,
            "hicache_disk_loaded_tokens": self.disk_loaded_tokens}
        loads = self.host_pool.loads.read_counters()
        stats.update(hicache_loads=loads.loads, hicache_load_seconds=loads.load_seconds,
                     hicache_load_wait_seconds=loads.waited_seconds,
                     hicache_save_fence_waits=self.host_pool.fence_waits)
        if self.prefetcher is not None:
            stats.update(hicache_prefetch_reads=self.prefetcher.started,
                         hicache_prefetch_wait_seconds=self.prefetcher.waited_seconds)
        if self.disk is not None:
            disk = self.disk.stats()
            stats.update(hicache_disk_bytes=disk["bytes"],
                         hicache_disk_written_pages=disk["written_pages"],
                         hicache_disk_loaded_pages=disk["loaded_pages"],
                         hicache_disk_corrupt_pages=disk["corrupt_pages"],
                         hicache_disk_removed_pages=disk["removed_pages"])
        return stats

    def snapshot(self, preview_tokens: int = 16) -> list[dict[str, Any]]:
        rows = super().snapshot(preview_tokens)
        tiers = {node.id: _tier(node) for node in self._nodes()}
        for row in rows:
            row["tier"] = tiers.get(row["id"], "device")
        return rows

    def check(self) -> None:
        assert not self._loading, "a load's host nodes are still marked"
        assert all(node.value is not None for node in self._pending), "a loading node left"
        evictable = protected = host_used = 0
        host_slots = []
        for node in self._nodes():
            assert node.key, f"node {node.id} has no tokens"
            assert node.parent.children[(node.namespace, node.key[0])] is node
            assert node.value is not None or node.host is not None, f"node {node.id}: no tier"
            assert node.lock_ref >= 0
            assert node.lock_ref >= max((c.lock_ref for c in node.children.values()), default=0)
            if node.value is None:
                assert node.lock_ref == 0, f"node {node.id} is locked but not on the device"
                assert all(c.value is None for c in node.children.values()), \
                    f"node {node.id}: a device child under a host-only node"
            else:
                assert len(node.value) == len(node.key), f"node {node.id} key/value"
                if node.lock_ref:
                    protected += len(node.key)
                else:
                    evictable += len(node.key)
            if node.host is not None:
                assert len(node.host) == len(node.key), f"node {node.id} key/host"
                host_used += len(node.host)
                host_slots.append(node.host)
        assert (evictable, protected) == (self._evictable, self._protected), \
            f"counted {(evictable, protected)} != kept {(self._evictable, self._protected)}"
        pool = self.host_pool
        assert host_used + pool.available() == pool.size, \
            f"host slots leaked: {host_used} used + {pool.available()} free != {pool.size}"
        if host_slots:
            assert len(torch.cat(host_slots).unique()) == host_used, "a host slot is shared"

    def close(self) -> None:
        self._settle()
        if self.prefetcher is not None:
            self.prefetcher.close()
        if self.disk is not None:
            self.disk.close()
        self.host_pool.release()
