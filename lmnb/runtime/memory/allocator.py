"""Free KV slots. Slot 0 is the padding slot: never handed out, so padded gathers may read it."""

from __future__ import annotations

import torch


class OutOfSlotsError(RuntimeError):
    pass


class KVAllocator:
    """Hands out and takes back token slots `1..size`; knows nothing of what they hold.

    Freed slots are queued and joined to the free list in one concatenation when an allocation
    needs them (`free` is called once per finished request or evicted node: joining each time
    would copy the whole free list on the device for every call)."""

    def __init__(self, size: int, device: torch.device) -> None:
        if size < 2:
            raise ValueError(f"the KV pool needs at least 2 slots, got {size}")
        self.size = size
        self.device = device
        self.clear()

    def available(self) -> int:
        return len(self._free) + self._queued_len

    def stats(self) -> dict[str, int]:
        """`max_total_tokens` (slots) and `free_tokens` (in no cache and no request)."""
        return {"max_total_tokens": self.size, "free_tokens": self.available()}

    def alloc(self, n: int) -> torch.Tensor:
        """[n] int64 slots on the pool's device."""
        if n > len(self._free):
            if n > self.available():
                raise OutOfSlotsError(f"need {n} KV slots, {self.available()} free")
            self._join_queued()
        taken, self._free = self._free[:n], self._free[n:]
        return taken

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            if slots.device != self.device or slots.dtype != torch.int64:
                slots = slots.to(device=self.device, dtype=torch.int64)
            self._queued.append(slots)
            self._queued_len += slots.numel()

    def free_slots(self) -> torch.Tensor:
        """Every free slot (for checks and tests)."""
        self._join_queued()
        return self._free

    def clear(self) -> None:
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)
        self._queued: list[torch.Tensor] = []
        self._queued_len = 0

    def _join_queued(self) -> None:
        if self._queued:
            self._free = torch.cat((self._free, *self._queued))
            self._queued, self._queued_len = [], 0
