"""The KV tensors, one K and one V buffer per layer.

    k_buffers[l]  [size + 1, kv_heads, head_dim]   row = slot; row 0 is padding (kept finite:
    v_buffers[l]  [size + 1, kv_heads, head_dim]   masked weights times NaN would still be NaN)

`dtype` is how K/V are stored, `compute_dtype` what the model computes them in (and attention
reads them as). FP8 storage (`kv_cache_dtype="fp8_e4m3"`): float8_e4m3fn with a per-tensor scale
of 1.0 (SGLang's default without a scales file), so storing is a saturating cast and reading one
back to `compute_dtype`: half the bytes of a 16-bit pool per token.
"""

from __future__ import annotations

from typing import Protocol

import torch

from lmnb.runtime.quantization import kv_cache_dtype_name

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


class PendingWrites(Protocol):
    """Rows being written by another stream (a hierarchical cache's loads, `hicache/loads.py`)."""

    def wait_layer(self, layer_id: int) -> None:
        """Layer `layer_id`'s rows are complete for the current stream."""


class KVStorage:
    def __init__(self, size: int, *, num_layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device,
                 compute_dtype: torch.dtype | None = None) -> None:
        self.size = size
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.compute_dtype = compute_dtype or dtype
        self.is_fp8 = dtype == torch.float8_e4m3fn
        self.device = device
        shape = (size + 1, kv_heads, head_dim)
        self.k_buffers = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for buffer in (*self.k_buffers, *self.v_buffers):
            buffer[0].zero_()
        self.pending: PendingWrites | None = None

    def ready(self, layer_id: int) -> None:
        """Called before layer `layer_id`'s rows are read (attention): pending writes into them
        are waited for, that layer's only."""
        if self.pending is not None:
            self.pending.wait_layer(layer_id)

    @staticmethod
    def bytes_per_token(*, num_layers: int, kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def set_kv(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> None:
        """k, v [num_tokens, kv_heads, head_dim] written to rows `slots` of layer `layer_id`."""
        if self.is_fp8:  # saturate: a plain cast past +-448 may give NaN
            k, v = k.clamp(-FP8_MAX, FP8_MAX), v.clamp(-FP8_MAX, FP8_MAX)
        self.k_buffers[layer_id][slots] = k.to(self.dtype)
        self.v_buffers[layer_id][slots] = v.to(self.dtype)

    def release(self) -> None:
        self.k_buffers.clear()
        self.v_buffers.clear()


def kv_cache_dtype(option: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's dtype for `EngineConfig.kv_cache_dtype` ('auto': the model's)."""
    name = kv_cache_dtype_name(option)
    return model_dtype if name == "auto" else getattr(torch, name)
