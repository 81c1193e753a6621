"""Arrival counters: int32 slots in which the programs of one launch that share a piece of work
count themselves in (a barrier, then one gpu-scope acq_rel atomic); the program that arrives
last finishes the piece (reads what the others stored, from L2) and sets the slot back to 0.

One zeroed buffer per device, shared by every kernel that counts (the FP8 rotary store,
`fused/gemv_rotary.py`): launches on a device run one at a time (one stream; a PDL launch waits for
the kernel in front before it touches memory) and each leaves its slots at zero, so CUDA-graph
replays need no memset. The buffer is allocated outside graph capture (the engine's eager
warm-up runs first); an outgrown one is kept, since captured graphs still count in it.
"""

from __future__ import annotations

import torch

_COUNTERS: dict[torch.device, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []
MIN_SLOTS = 1024


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """int32 [n] on `device`, zero between launches. Raises while a CUDA graph is being captured
    and the device has fewer than n (an allocation inside a capture is never zeroed eagerly)."""
    have = _COUNTERS.get(device)
    if have is not None and have.numel() >= n:
        return have[:n]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{n} arrival counters are needed inside a CUDA-graph capture, "
                           f"{0 if have is None else have.numel()} were allocated: an eager "
                           "run of the same launch allocates them before the capture")
    if have is not None:
        _OUTGROWN.append(have)
    have = torch.zeros(max(n, MIN_SLOTS), dtype=torch.int32, device=device)
    _COUNTERS[device] = have
    return have[:n]
