"""The host tier's KV memory: per-layer K and V rows in (pinned, on CUDA) host memory, its own
slot allocator, and the copies between it and the device pool (`KVStorage`).

    k[l], v[l]  [size + 1, kv_heads, head_dim]   host row = host slot (row 0 unused), layer first

On CUDA every copy runs on one side stream: it first waits for the work already queued on the
compute stream (the rows it reads or overwrites are final there), and the compute stream then
waits for its event, so a forward queued afterwards sees the loaded rows and never overwrites a
row before it was saved. Host rows read by the CPU (the disk tier) wait for `synchronize()`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from lmnb.runtime.memory import KVAllocator, KVStorage


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


class HostKVPool:
    def __init__(self, size: int, device_kv: KVStorage) -> None:
        self.size = size
        self.device_kv = device_kv
        self.allocator = KVAllocator(size, torch.device("cpu"))
        cuda = device_kv.device.type == "cuda"
        shape = (size + 1, device_kv.kv_heads, device_kv.head_dim)

        def buffer() -> torch.Tensor:
            return torch.empty(shape, dtype=device_kv.dtype, pin_memory=cuda)

        self.k = [buffer() for _ in range(device_kv.num_layers)]
        self.v = [buffer() for _ in range(device_kv.num_layers)]
        self._stream = torch.cuda.Stream(device_kv.device) if cuda else None
        self._done: torch.cuda.Event | None = None

    @staticmethod
    def bytes_per_token(device_kv: KVStorage) -> int:
        return KVStorage.bytes_per_token(num_layers=device_kv.num_layers,
                                         kv_heads=device_kv.kv_heads,
                                         head_dim=device_kv.head_dim, dtype=device_kv.dtype)

    def available(self) -> int:
        return self.allocator.available()

    @contextmanager
    def _copying(self) -> Iterator[None]:
        if self._stream is None:
            yield
            return
        compute = torch.cuda.current_stream(self.device_kv.device)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            yield
            self._done = torch.cuda.Event()
            self._done.record(self._stream)
        compute.wait_event(self._done)

    def save(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        """Device rows `device_slots` -> host rows `host_slots` (same length), every layer."""
        runs = host_runs(host_slots)
        device = self.device_kv
        with self._copying():
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
        with self._copying():
            for layer in range(device.num_layers):
                for src, dst in ((self.k[layer], device.k_buffers[layer]),
                                 (self.v[layer], device.v_buffers[layer])):
                    for begin, first, n in runs:
                        rows = src[first:first + n].to(device.device, non_blocking=True)
                        dst[target[begin:begin + n]] = rows

    def read(self, host_slots: torch.Tensor) -> torch.Tensor:
        """[2, layers, n, kv_heads, head_dim] on the CPU (K then V) of host rows `host_slots`."""
        self.synchronize()
        return torch.stack([torch.stack([buf[host_slots] for buf in bufs])
                            for bufs in (self.k, self.v)])

    def synchronize(self) -> None:
        if self._done is not None:
            self._done.synchronize()

    def release(self) -> None:
        self.synchronize()
        self.k.clear()
        self.v.clear()
