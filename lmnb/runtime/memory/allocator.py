"""Free KV slots. Slot 0 is the padding slot: never handed out, so padded gathers may read it."""

from __future__ import annotations

import torch


class OutOfSlotsError(RuntimeError):
    pass


class KVAllocator:
    """Hands out and takes back token slots `1..size`; knows nothing of what they hold."""

    def __init__(self, size: int, device: torch.device) -> None:
        if size < 2:
            raise ValueError(f"the KV pool needs at least 2 slots, got {size}")
        self.size = size
        self.device = device
        self._free = torch.arange(1, size + 1, dtype=torch.int64, device=device)

    def available(self) -> int:
        return len(self._free)

    def stats(self) -> dict[str, int]:
        """`max_total_tokens` (slots) and `free_tokens` (in no cache and no request)."""
        return {"max_total_tokens": self.size, "free_tokens": self.available()}

    def alloc(self, n: int) -> torch.Tensor:
        """[n] int64 slots on the pool's device."""
        if n > len(self._free):
            raise OutOfSlotsError(f"need {n} KV slots, {len(self._free)} free")
        taken, self._free = self._free[:n], self._free[n:]
        return taken

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._free = torch.cat((self._free, slots.to(device=self.device, dtype=torch.int64)))

    def clear(self) -> None:
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)
