"""The host tier's KV memory: per-layer K and V rows in (pinned, on CUDA) host memory, its own
slot allocator, and the copies between it and the device pool (`KVStorage`).

    k[l], v[l]  [size + 1, kv_heads, head_dim]   host row = host slot (row 0 unused), layer first

On CUDA every copy runs on one side stream: it first waits for the work already queued on the
compute stream (the rows it reads or overwrites are final there). The compute stream waits for a
load's event at once (a forward queued afterwards reads the loaded rows), and for the saves'
event at `fence()`, which the cache calls before device rows that were saved can be reused.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from lmnb.runtime.memory import KVStorage, OutOfSlotsError


def host_runs(slots: torch.Tensor) -> list[tuple[int, int, int]]:
    """(start in `slots`, first slot, length) of each run of consecutive slots: each run is one
    contiguous copy."""
    if not slots.numel():
        return []
    values = slots.tolist()
    runs, begin = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[i - 1] + 1:
            runs.append((begin, values[begin], i - begin))
            begin = i
    return runs


class HostSlots:
    """Host slots `1..size`, handed out in increasing order: freed nodes' slots merge back into
    long runs, so that a node's rows are a few contiguous copies."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.clear()

    def available(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> torch.Tensor:
        if n > len(self._free):
            raise OutOfSlotsError(f"need {n} host KV slots, {len(self._free)} free")
        if not self._sorted:
            self._free = self._free.sort().values
            self._sorted = True
        taken, self._free = self._free[:n], self._free[n:]
        return taken

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._free = torch.cat((self._free, slots.to(torch.int64)))
            self._sorted = False

    def clear(self) -> None:
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64)
        self._sorted = True


class HostKVPool:
    def __init__(self, size: int, device_kv: KVStorage) -> None:
        self.size = size
        self.device_kv = device_kv
        self.allocator = HostSlots(size)
        cuda = device_kv.device.type == "cuda"
        shape = (size + 1, device_kv.kv_heads, device_kv.head_dim)

        def buffer() -> torch.Tensor:
            return torch.empty(shape, dtype=device_kv.dtype, pin_memory=cuda)

        self.k = [buffer() for _ in range(device_kv.num_layers)]
        self.v = [buffer() for _ in range(device_kv.num_layers)]
        self._stream = torch.cuda.Stream(device_kv.device) if cuda else None
        self._done: torch.cuda.Event | None = None
        self._saved: torch.cuda.Event | None = None  # the last save the compute stream may race

    @staticmethod
    def bytes_per_token(device_kv: KVStorage) -> int:
        return KVStorage.bytes_per_token(num_layers=device_kv.num_layers,
                                         kv_heads=device_kv.kv_heads,
                                         head_dim=device_kv.head_dim, dtype=device_kv.dtype)

    def available(self) -> int:
        return self.allocator.available()

    @contextmanager
    def _copying(self, *, wait: bool) -> Iterator[None]:
        if self._stream is None:
            yield
            return
        compute = torch.cuda.current_stream(self.device_kv.device)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            yield
            self._done = torch.cuda.Event()
            self._done.record(self._stream)
        if wait:
            compute.wait_event(self._done)
        else:
            self._saved = self._done

    def fence(self) -> None:
        """The compute stream waits for the saves issued so far (before their device rows are
        reused)."""
        if self._saved is not None:
            torch.cuda.current_stream(self.device_kv.device).wait_event(self._saved)
            self._saved = None

    def save(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        """Device rows `device_slots` -> host rows `host_slots` (same length), every layer."""
        runs = host_runs(host_slots)
        device = self.device_kv
        if self._stream is not None:  # read on the side stream after its owner may drop it
            device_slots.record_stream(self._stream)
        with self._copying(wait=False):
            for layer in range(device.num_layers):
                for src, dst in ((device.k_buffers[layer], self.k[layer]),
                                 (device.v_buffers[layer], self.v[layer])):
                    rows = src[device_slots]
                    for begin, first, n in runs:
                        dst[first:first + n].copy_(rows[begin:begin + n],
                                                   non_blocking=self._stream is not None)

    def load(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Host rows `host_slots` -> device rows `device_slots` (same length), every layer."""
        runs = host_runs(host_slots)
        device = self.device_kv
        target = device_slots.to(device.device)
        with self._copying(wait=True):
            for layer in range(device.num_layers):
                for src, dst in ((self.k[layer], device.k_buffers[layer]),
                                 (self.v[layer], device.v_buffers[layer])):
                    for begin, first, n in runs:
                        rows = src[first:first + n].to(device.device, non_blocking=True)
                        dst[target[begin:begin + n]] = rows

    def synchronize(self) -> None:
        if self._done is not None:
            self._done.synchronize()

    def release(self) -> None:
        self.synchronize()
        self.k.clear()
        self.v.clear()
