"""The switch between a layer's torch path and its fused Triton kernel.

A `Fusable` layer runs torch ops (the CPU path and the reference) unless its `fused` flag is set;
`set_fused_kernels(model, True)` sets it on every such layer of a model. The engine turns them on
for CUDA models unless `EngineConfig.disable_fused_kernels` (the ablation); tests turn them on for
CPU models too, where the kernels run in Triton's interpreter (`TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn


class Fusable(nn.Module):
    """A layer with a fused kernel: `forward` takes it when `self.fused` is set."""

    fused: bool = False


def set_fused_kernels(model: nn.Module, enabled: bool) -> int:
    """Sets every `Fusable` layer of `model` to its fused (True) or torch (False) path; returns
    how many layers it set."""
    count = 0
    for module in model.modules():
        if isinstance(module, Fusable):
            module.fused = enabled
            count += 1
    return count


def fused_kernels_enabled(model: nn.Module) -> bool:
    """Whether any layer of `model` runs a fused kernel."""
    return any(isinstance(m, Fusable) and m.fused for m in model.modules())


def fused_kernels_available(device: torch.device) -> bool:
    """Whether the engine runs fused kernels by default on `device`: compiled Triton, so CUDA
    with triton installed (on CPU the interpreter is for tests, far slower than torch)."""
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None
