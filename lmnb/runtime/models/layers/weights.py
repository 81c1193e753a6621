"""Checkpoint tensors as the parallel layers read them: whole (`torch.Tensor`) or lazily, a
`CheckpointSlice` that reads from the file only the rows or columns a rank keeps."""

from __future__ import annotations

from typing import Any

import torch

WeightSource = Any  # torch.Tensor | CheckpointSlice: both have `shape`, `dtype` and `narrow`


_SAFETENSORS_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
                       "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
                       "F64": torch.float64}


class CheckpointSlice:
    """A safetensors tensor not read yet (`safe_open(...).get_slice(name)`): `narrow` reads one
    block of it, `load` all of it. Valid while its file is open."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self.shape = torch.Size(handle.get_shape())

    @property
    def dtype(self) -> torch.dtype:
        """The stored dtype (what tells FP8 checkpoint tensors apart; other kinds read as
        float32)."""
        return _SAFETENSORS_DTYPES.get(self._handle.get_dtype(), torch.float32)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._handle[index]

    def load(self) -> torch.Tensor:
        return self._handle[...] if len(self.shape) == 0 else self._handle[:]


def materialize(source: WeightSource) -> torch.Tensor:
    """The whole tensor of `source`."""
    return source.load() if isinstance(source, CheckpointSlice) else source


def copy_weight(param: torch.Tensor, source: WeightSource, name: str) -> None:
    """`param.copy_(source)` after checking that the shapes agree (the checkpoint's name in the
    error)."""
    if tuple(param.shape) != tuple(source.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(source.shape)} != model shape "
                         f"{tuple(param.shape)}")
    param.copy_(materialize(source))


# A layer's FP8 KV scale in compressed-tensors checkpoints (`kv_cache_scheme`, strategy 'tensor'):
# `<layer>.self_attn.k_scale` / `v_scale`, or older `<layer>.self_attn.k_proj.output_scale`.
_KV_SCALE_SUFFIXES = {".k_scale": 0, ".v_scale": 1, ".k_proj.output_scale": 0,
                      ".v_proj.output_scale": 1}


def kv_scale_place(name: str) -> tuple[str, int] | None:
    """(the attention module, 0 for K | 1 for V) of a checkpoint's FP8 KV scale `name`; None
    for any other tensor."""
    for suffix, which in _KV_SCALE_SUFFIXES.items():
        module = name.removesuffix(suffix)
        if module != name and module.endswith(".self_attn"):
            return module, which
    return None


def scalar_scale(source: WeightSource, name: str) -> float:
    """A per-tensor scale's value; an error for any other shape or a value that is not a
    positive finite number."""
    tensor = materialize(source).float().reshape(-1)
    if tensor.numel() != 1:
        raise ValueError(f"{name}: {tensor.numel()} values; lmnb reads one FP8 KV scale per "
                         "tensor (kv_cache_scheme strategy 'tensor')")
    value = float(tensor[0])
    if not 0 < value < float("inf"):
        raise ValueError(f"{name}: scale {value} is not a positive finite number")
    return value
