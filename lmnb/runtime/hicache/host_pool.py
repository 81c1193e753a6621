"""The host tier's KV memory: per-layer K and V rows in (pinned, on CUDA) host memory, its own
slot allocator, and the copies between it and the device pool (`KVStorage`).

    k[l], v[l]  [size + 1, kv_heads, head_dim]   host row = host slot (row 0 unused), layer first

On CUDA saves (device -> host) and loads (host -> device, `loads.LayerLoads`: overlapped with
the forward layer by layer) run on two side streams, so that they run side by side (the link
copies both ways at once) and a load never queues behind the saves. A save first waits for the
work queued on the compute stream (the rows it reads are final there) and returns a ticket; the
compute stream waits for a save only at `fence(ticket)`, which the cache calls before device
rows that were saved are reused: an eviction waits for the saves of the rows it frees only.
"""

from __future__ import annotations

from collections import deque

import torch

from lmnb.runtime.hicache.loads import LayerLoads
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
        self.loads = LayerLoads(device_kv)  # host -> device, on their own stream
        self._stream = torch.cuda.Stream(device_kv.device) if cuda else None  # saves
        self._ticket = 0  # saves issued
        self._saves: deque[tuple[int, torch.cuda.Event]] = deque()  # not known done yet
        self.fence_waits = 0  # fences that found their saves still running

    @staticmethod
    def bytes_per_token(device_kv: KVStorage) -> int:
        return KVStorage.bytes_per_token(num_layers=device_kv.num_layers,
                                         kv_heads=device_kv.kv_heads,
                                         head_dim=device_kv.head_dim, dtype=device_kv.dtype)

    def available(self) -> int:
        return self.allocator.available()

    def fence(self, ticket: int) -> None:
        """Device rows read by saves up to `ticket` may be reused from now on: the compute
        stream waits for those saves (only: later ones go on)."""
        last = None
        while self._saves and self._saves[0][0] <= ticket:
            last = self._saves.popleft()[1]
        if last is not None and not last.query():
            self.fence_waits += 1
            torch.cuda.current_stream(self.device_kv.device).wait_event(last)

    def done_ticket(self) -> int:
        """Every save up to this ticket is known to be done."""
        while self._saves and self._saves[0][1].query():
            self._saves.popleft()
        return self._saves[0][0] - 1 if self._saves else self._ticket

    def save(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> int:
        """Device rows `device_slots` -> host rows `host_slots` (same length), every layer, on
        the save stream (after the compute stream's work so far); returns the save's ticket for
        `fence`."""
        self._ticket += 1
        runs = host_runs(host_slots)
        device = self.device_kv
        # Loads queued earlier go first: they read host rows this save may overwrite, and may
        # write the device rows it reads.
        self.loads.before_host_reuse(self._stream)
        if self._stream is None:
            for layer in range(device.num_layers):
                for src, dst in ((device.k_buffers[layer], self.k[layer]),
                                 (device.v_buffers[layer], self.v[layer])):
                    rows = src[device_slots]
                    for begin, first, n in runs:
                        dst[first:first + n] = rows[begin:begin + n]
            return self._ticket
        self.done_ticket()  # forgets the saves that are done
        self._stream.wait_stream(torch.cuda.current_stream(device.device))
        device_slots.record_stream(self._stream)  # read after its owner may drop it
        with torch.cuda.stream(self._stream):
            for layer in range(device.num_layers):
                for src, dst in ((device.k_buffers[layer], self.k[layer]),
                                 (device.v_buffers[layer], self.v[layer])):
                    rows = src[device_slots]
                    for begin, first, n in runs:
                        dst[first:first + n].copy_(rows[begin:begin + n], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._saves.append((self._ticket, event))
        return self._ticket

    def load(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Queues host rows `host_slots` -> device rows `device_slots` (same length), every
        layer (`LayerLoads`: copied when the forward first needs them)."""
        runs = host_runs(host_slots)

        def rows(layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
            k, v = self.k[layer], self.v[layer]
            return [(k[first:first + n], v[first:first + n]) for _, first, n in runs]

        self.loads.add(rows, device_slots)

    def synchronize(self) -> None:
        self.loads.settle()
        if self._saves:
            self._saves[-1][1].synchronize()
            self._saves.clear()

    def release(self) -> None:
        self.synchronize()
        self.k.clear()
        self.v.clear()
