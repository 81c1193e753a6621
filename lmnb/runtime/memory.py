"""KV memory: request slots (`ReqToTokenPool`) and token slots (`TokenToKVPool`), one token a slot.

    req_to_token  [max_reqs, max_context_len]  int64: position of a request's token -> KV slot
    k_buffers[l]  [size + 1, kv_heads, head_dim]  slot 0 is padding: written by nobody that matters,
    v_buffers[l]  [size + 1, kv_heads, head_dim]  read by padded gathers, never handed out
"""

from __future__ import annotations

import torch


class OutOfSlotsError(RuntimeError):
    pass


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


class TokenToKVPool:
    def __init__(self, size: int, *, num_layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.size = size
        self.dtype = dtype
        self.device = device
        shape = (size + 1, kv_heads, head_dim)
        # Slots are written before they are read; only the padding slot must hold finite values.
        self.k_buffers = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for buffer in (*self.k_buffers, *self.v_buffers):
            buffer[0].zero_()
        self._free_slots = torch.arange(1, size + 1, dtype=torch.int64, device=device)

    @staticmethod
    def bytes_per_token(*, num_layers: int, kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def available(self) -> int:
        return len(self._free_slots)

    def alloc(self, n: int) -> torch.Tensor:
        if n > len(self._free_slots):
            raise OutOfSlotsError(f"need {n} KV slots, {len(self._free_slots)} free")
        taken, self._free_slots = self._free_slots[:n], self._free_slots[n:]
        return taken

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._free_slots = torch.cat((self._free_slots, slots.to(torch.int64)))

    def clear(self) -> None:
        self._free_slots = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)

    def set_kv(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> None:
        self.k_buffers[layer_id][slots] = k.to(self.dtype)
        self.v_buffers[layer_id][slots] = v.to(self.dtype)
