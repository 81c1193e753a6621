"""Request rows of the KV index table.

    req_to_token  [max_reqs, max_context_len]  int64: position of a live request's token -> KV slot
"""

from __future__ import annotations

import torch

from lmnb.runtime.memory.allocator import OutOfSlotsError


class ReqToTokenPool:
    def __init__(self, max_reqs: int, max_context_len: int, device: torch.device) -> None:
        self.size = max_reqs
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((max_reqs, max_context_len), dtype=torch.int64,
                                        device=device)
        self._free: list[int] = list(range(max_reqs))

    def available(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise OutOfSlotsError("no free request slot")
        return self._free.pop()

    def free(self, index: int) -> None:
        self._free.append(index)
