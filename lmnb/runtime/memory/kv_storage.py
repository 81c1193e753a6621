"""The KV tensors, one K and one V buffer per layer.

    k_buffers[l]  [size + 1, kv_heads, head_dim]   row = slot; row 0 is padding (kept finite:
    v_buffers[l]  [size + 1, kv_heads, head_dim]   masked weights times NaN would still be NaN)

`dtype` is how K/V are stored, `compute_dtype` what the model computes them in (and attention
reads them as). FP8 storage (`kv_cache_dtype="fp8_e4m3"`): float8_e4m3fn with one float32 scale
per token and KV head, computed as the row is written (dynamic, no calibration):

    k_scales[l]  [size + 1, kv_heads] float32   k[s, h] ~= k_buffers[l][s, h] * k_scales[l][s, h]
    v_scales[l]  [size + 1, kv_heads] float32   scale = amax of the row / 448 (row 0: 1.0)

The scales are head-major in memory ([kv_heads, size + 1] contiguous, seen through its transpose,
strides (1, size + 1)): a decode program reads one KV head's scales for a tile of slots, and a
request's slots are mostly runs, so its tile's scales share a few 32-byte sectors (slot-major,
each scale would cost a sector of its own). Every kernel takes both strides; torch code indexes
the view as any [slots, kv_heads] tensor.

`fp8_scales="tensor"` (for backends that read one scale per tensor: FlashInfer) keeps instead
one fixed scale per layer for K and one for V (`tensor_scales`, SGLang's and vLLM's default 1.0
without a calibrated checkpoint); `k_scales` / `v_scales` are then that scale seen as
[size + 1, kv_heads] with slot stride 0 (no memory), so the same readers serve both, and writers
told by the 0 stride (`fixed_fp8_scales`) divide by it and store no scale.

With one fixed scale, e4m3's 3-bit mantissa puts ~3% of error on K's few large channels, which
dominate q.k; a per-row scale stores each head's largest element exactly. On SmolLM2-135M it moves
top-1 agreement with fp32 from 93.4% to 95.2% (bench/fp8_sensitivity.py), for 4 bytes per head
and token beside head_dim bytes (+3% of the pool for head_dim 128, +6% for 64).
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch

from lmnb.runtime.quantization import kv_cache_dtype_name

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_MIN_SCALE = 1e-12  # an all-zero row: any positive scale gives zeros back


def quantize_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, kv_heads, head_dim] -> (float8_e4m3fn like x, float32 scales [tokens, kv_heads]),
    one scale per (token, head): amax / 448."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / FP8_MAX).clamp_min(_MIN_SCALE)
    return (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def dequantize_heads(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 [..., kv_heads, head_dim] and scales [..., kv_heads] -> `dtype`."""
    return (x.float() * scale[..., None]).to(dtype)


Fp8Scales = Literal["token", "tensor"]  # an FP8 pool's scales: per (token, KV head) | per tensor
TENSOR_SCALE = 1.0  # "tensor" pools' K and V scale (SGLang's and vLLM's uncalibrated default)


def quantize_fixed(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x -> float8_e4m3fn codes of x / scale, clamped to +-448 (a "tensor" pool's rows)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fixed_fp8_scales(scales: torch.Tensor) -> bool:
    """Whether an FP8 pool's [slots, kv_heads] scales are one fixed scale (slot stride 0: a
    "tensor" pool's): writers divide by it and store none."""
    return scales.stride(0) == 0


def _head_major_ones(slots: int, kv_heads: int, device: torch.device) -> torch.Tensor:
    """[slots, kv_heads] float32 ones whose memory is [kv_heads, slots] (see the docstring)."""
    return torch.ones((kv_heads, slots), dtype=torch.float32, device=device).t()


def fixed_scale_view(scale: float, slots: int, kv_heads: int, device: torch.device
                     ) -> torch.Tensor:
    """[slots, kv_heads] float32 `scale` with slot stride 0 (a "tensor" pool's scales)."""
    return torch.full((1, kv_heads), scale, dtype=torch.float32, device=device).expand(
        slots, kv_heads)


class PendingWrites(Protocol):
    """Rows being written by another stream (a hierarchical cache's loads, `hicache/loads.py`)."""

    def wait_layer(self, layer_id: int) -> None:
        """Layer `layer_id`'s rows are complete for the current stream."""


class KVStorage:
    def __init__(self, size: int, *, num_layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device,
                 compute_dtype: torch.dtype | None = None, fp8_scales: Fp8Scales = "token"
                 ) -> None:
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
        # FP8: per (slot, head) or fixed scales (see the module docstring); else empty
        self.fp8_scales: Fp8Scales = fp8_scales
        layers = range(num_layers) if self.is_fp8 else range(0)
        self.tensor_scales = [(TENSOR_SCALE, TENSOR_SCALE) for _ in layers
                              ] if fp8_scales == "tensor" else []
        if self.tensor_scales:
            self.k_scales = [fixed_scale_view(k, size + 1, kv_heads, device)
                             for k, _ in self.tensor_scales]
            self.v_scales = [fixed_scale_view(v, size + 1, kv_heads, device)
                             for _, v in self.tensor_scales]
        else:
            self.k_scales = [_head_major_ones(size + 1, kv_heads, device) for _ in layers]
            self.v_scales = [_head_major_ones(size + 1, kv_heads, device) for _ in layers]
        self.pending: PendingWrites | None = None

    def ready(self, layer_id: int) -> None:
        """Called before layer `layer_id`'s rows are read (attention): pending writes into them
        are waited for, that layer's only."""
        if self.pending is not None:
            self.pending.wait_layer(layer_id)

    @staticmethod
    def bytes_per_token(*, num_layers: int, kv_heads: int, head_dim: int,
                        dtype: torch.dtype, fp8_scales: Fp8Scales = "token") -> int:
        per_head = head_dim * torch.empty((), dtype=dtype).element_size()
        if dtype == torch.float8_e4m3fn and fp8_scales == "token":
            per_head += 4  # its float32 scale
        return 2 * num_layers * kv_heads * per_head

    def scales(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer `layer_id`'s (k_scales, v_scales) [size + 1, kv_heads] (FP8 pools; else None)."""
        return (self.k_scales[layer_id], self.v_scales[layer_id]) if self.is_fp8 else None

    def set_tensor_scales(self, layer_id: int, k_scale: float, v_scale: float) -> None:
        """A "tensor" pool's fixed K and V scales of layer `layer_id` (a calibrated checkpoint's),
        before any of its rows is written."""
        assert self.tensor_scales, "only an FP8 pool with fp8_scales='tensor' has fixed scales"
        self.tensor_scales[layer_id] = (k_scale, v_scale)
        self.k_scales[layer_id] = fixed_scale_view(k_scale, self.size + 1, self.kv_heads,
                                                   self.device)
        self.v_scales[layer_id] = fixed_scale_view(v_scale, self.size + 1, self.kv_heads,
                                                   self.device)

    def set_kv(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> None:
        """k, v [num_tokens, kv_heads, head_dim] written to rows `slots` of layer `layer_id`."""
        if self.tensor_scales:
            k_scale, v_scale = self.tensor_scales[layer_id]
            self.k_buffers[layer_id][slots] = quantize_fixed(k, k_scale)
            self.v_buffers[layer_id][slots] = quantize_fixed(v, v_scale)
            return
        if self.is_fp8:
            k_q, k_scale = quantize_heads(k)
            v_q, v_scale = quantize_heads(v)
            self.k_buffers[layer_id][slots] = k_q
            self.v_buffers[layer_id][slots] = v_q
            self.k_scales[layer_id][slots] = k_scale
            self.v_scales[layer_id][slots] = v_scale
            return
        self.k_buffers[layer_id][slots] = k.to(self.dtype)
        self.v_buffers[layer_id][slots] = v.to(self.dtype)

    def read(self, layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) [*slots.shape, kv_heads, head_dim] of rows `slots` in `compute_dtype`."""
        k, v = self.k_buffers[layer_id][slots], self.v_buffers[layer_id][slots]
        if not self.is_fp8:
            return k, v
        return (dequantize_heads(k, self.k_scales[layer_id][slots], self.compute_dtype),
                dequantize_heads(v, self.v_scales[layer_id][slots], self.compute_dtype))

    def release(self) -> None:
        self.k_buffers.clear()
        self.v_buffers.clear()
        self.k_scales.clear()
        self.v_scales.clear()


def kv_cache_dtype(option: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's dtype for `EngineConfig.kv_cache_dtype` ('auto': the model's)."""
    name = kv_cache_dtype_name(option)
    return model_dtype if name == "auto" else getattr(torch, name)
