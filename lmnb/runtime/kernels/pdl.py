"""Programmatic dependent launch (Hopper and later): a kernel launched with it may be scheduled
while the kernel before it in the stream is still running its last programs, instead of after
it has finished, so launch latency and the ramp of its first wave hide behind the tail of the
previous kernel. At decode, and at batch 1 most of all, a step is ~200 short kernels (a GEMV of
a few MB takes ~8-40 us), so that gap is a visible share of the step.

A kernel taking part calls `wait_for_previous(USE_PDL)` first: `griddepcontrol.wait` blocks its
programs until every kernel before it has finished and its memory is visible (so nothing it
reads or writes races with them), then `griddepcontrol.launch_dependents` lets the next kernel
be scheduled (which only happens once all of this kernel's programs have started). Kernels
that do not take part (cuBLAS, torch) keep the stream's order; a PDL launch behind one of them
waits for it as any launch does. CUDA-graph capture keeps the programmatic edges.

`launch_args(device)` gives the launch keywords: `USE_PDL` for the kernel and Triton's
`launch_pdl` option, only on a CUDA device of compute capability >= 9.0, compiled (not the
interpreter), unless LMNB_DISABLE_PDL=1.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from lmnb.runtime.kernels.interpreter import INTERPRETED


@triton.jit
def wait_for_previous(USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@functools.lru_cache(maxsize=16)
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` are launched with programmatic dependent launch."""
    if device.type != "cuda" or INTERPRETED or os.environ.get("LMNB_DISABLE_PDL") == "1":
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def launch_args(device: torch.device) -> dict[str, bool]:
    """Keywords for a `kernel[grid](...)` launch whose kernel takes `USE_PDL: tl.constexpr`."""
    return {"USE_PDL": True, "launch_pdl": True} if enabled(device) else {}
