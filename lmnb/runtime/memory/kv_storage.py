"""The KV tensors, one K and one V buffer per layer.

    k_buffers[l]  [size + 1, kv_heads, head_dim]   row = slot; row 0 is padding (kept finite:
    v_buffers[l]  [size + 1, kv_heads, head_dim]   masked weights times NaN would still be NaN)
"""

from __future__ import annotations

import torch


class KVStorage:
    def __init__(self, size: int, *, num_layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.size = size
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        shape = (size + 1, kv_heads, head_dim)
        self.k_buffers = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for buffer in (*self.k_buffers, *self.v_buffers):
            buffer[0].zero_()

    @staticmethod
    def bytes_per_token(*, num_layers: int, kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def set_kv(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> None:
        """k, v [num_tokens, kv_heads, head_dim] written to rows `slots` of layer `layer_id`."""
        self.k_buffers[layer_id][slots] = k.to(self.dtype)
        self.v_buffers[layer_id][slots] = v.to(self.dtype)

    def release(self) -> None:
        self.k_buffers.clear()
        self.v_buffers.clear()
