"""Disk pages read ahead, off the scheduler thread: when a request arrives, an I/O thread reads
the pages of its prompt that continue what the tree holds (device or host) into host memory
(pinned on CUDA; whether there is anything to read is one stat of the first page, on the
scheduler thread); when the request is admitted, the scheduler only queues their host -> device
copy (`loads.LayerLoads`), overlapped with the forward like a host hit.

Policy (documented in the README): a request whose read is still running waits in the queue
while others are admitted; when nothing else can run, the scheduler waits for it (up to
`WAIT_S`; a read slower than that is abandoned and the request computes its prefix). A read
stages at most what the host pool could hold, `max_tokens` in all; the oldest finished reads
go first when more is asked, and a read that does not fit is not started (its request computes).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import torch

from lmnb.runtime.hicache.disk import DiskTier

WAIT_S = 30.0  # the longest an otherwise idle scheduler waits for one read
MAX_JOBS = 1024  # reads remembered (finished ones are dropped first)


@dataclass(slots=True)
class _Read:
    start: int  # first token staged (page-aligned)
    tokens: int  # at most this many staged
    future: Future[torch.Tensor | None]  # [2, layers, n, kv_heads, head_dim] from `start`
    abandoned: bool = False


class DiskPrefetcher:
    def __init__(self, disk: DiskTier, *, max_tokens: int) -> None:
        self.disk = disk
        self.max_tokens = max_tokens
        self.pin = disk.kv.device.type == "cuda"
        self._reads: OrderedDict[tuple[int, ...], _Read] = OrderedDict()
        # a few reads side by side: a short one does not queue behind a long one
        self._worker = ThreadPoolExecutor(max_workers=4, thread_name_prefix="lmnb-hicache-io")
        self.started = 0
        self.waited_seconds = 0.0  # the scheduler waiting for reads (nothing else to run)
        self.abandoned = 0

    def _id(self, key: list[int]) -> tuple[int, ...]:
        return tuple(key[:len(key) // self.disk.page_tokens * self.disk.page_tokens])

    # ---- scheduler thread ----------------------------------------------------------------------
    def known(self, key: list[int]) -> bool:
        return self._id(key) in self._reads

    def start(self, key: list[int], covered: int) -> None:
        """Reads the full pages of `key` from the one holding token `covered` (what the tree
        holds) on, unless a read of them is known already."""
        ident = self._id(key)
        size = self.disk.page_tokens
        first = covered // size * size
        if ident in self._reads or len(ident) <= first:
            return
        if not self.disk.has_page(ident, first // size):
            return  # nothing to read (most prompts): the request does not wait at all
        need = len(ident) - first
        if not self._make_room(need):
            return
        self.started += 1
        future = self._worker.submit(self.disk.load, list(ident), first, need, pin=self.pin)
        self._reads[ident] = _Read(first, need, future)
        while len(self._reads) > MAX_JOBS:
            self._reads.popitem(last=False)

    def _make_room(self, need: int) -> bool:
        staged = sum(read.tokens for read in self._reads.values())
        for ident in list(self._reads):
            if staged + need <= self.max_tokens:
                break
            read = self._reads[ident]
            if read.future.done():
                staged -= read.tokens
                del self._reads[ident]
        return staged + need <= self.max_tokens

    def running(self, key: list[int]) -> bool:
        read = self._reads.get(self._id(key))
        return read is not None and not read.abandoned and not read.future.done()

    def wait(self, key: list[int], timeout_s: float = WAIT_S) -> None:
        read = self._reads.get(self._id(key))
        if read is None or read.abandoned:
            return
        begin = time.perf_counter()
        try:
            read.future.result(timeout=timeout_s)
        except FutureTimeout:
            read.abandoned = True
            self.abandoned += 1
        except Exception:  # a failed read is a miss (taken as None)
            pass
        self.waited_seconds += time.perf_counter() - begin

    def take(self, key: list[int], start: int) -> torch.Tensor | None:
        """The staged KV of `key`'s tokens from `start` on, if a finished read covers `start`
        (the read is forgotten); None otherwise."""
        ident = self._id(key)
        read = self._reads.get(ident)
        if read is None or read.abandoned or not read.future.done():
            return None
        del self._reads[ident]
        try:
            data = read.future.result()
        except Exception:
            return None
        if data is None or not read.start <= start < read.start + data.shape[2]:
            return None
        return data[:, :, start - read.start:]

    def close(self) -> None:
        for read in self._reads.values():
            read.future.cancel()
        self._worker.shutdown(wait=True)
        self._reads.clear()
