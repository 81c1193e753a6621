"""The CUDA device's multiprocessor count, which the kernels' launch rules read (decode
attention's tile by waves, the W8A8 GEMM's rows rule)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def multiprocessors(device: torch.device) -> int | None:
    """The CUDA device's multiprocessors; None elsewhere (the interpreter)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count
