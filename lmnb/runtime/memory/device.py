"""What the device's memory holds now, for `Runtime.stats()` and the notebook's metrics bar."""

from __future__ import annotations

import torch

GIB = 1 << 30


def device_memory(device: torch.device) -> dict[str, float] | None:
    """On CUDA: this process's allocated and reserved memory and the device's total, in GiB;
    None on other devices (no allocator statistics to report)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return {"allocated_gb": round(torch.cuda.memory_allocated(device) / GIB, 3),
            "reserved_gb": round(torch.cuda.memory_reserved(device) / GIB, 3),
            "total_gb": round(torch.cuda.get_device_properties(device).total_memory / GIB, 3)}
