"""The mode Triton kernel tests run in: compiled on the GPU with CUDA, in Triton's CPU interpreter
on CPU tensors without it (or with TRITON_INTERPRET=1 already set).

Triton decides at decoration time, so a test module imports this before any kernel module:

    from tests.triton_modes import DEVICES, KERNEL_DEVICE, SAME_TRITON_MODE

    # isort: split
    from lmnb.runtime.kernels.fused import ...

    pytestmark = SAME_TRITON_MODE

    @pytest.mark.parametrize("device", DEVICES)   # "cpu" interpreted, or "cuda" compiled
    def test_kernel(device): ...

Importing it skips the whole module where triton or numpy (the interpreter's) is missing.
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available()
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
pytest.importorskip("numpy")

from lmnb.runtime.kernels import interpreter  # noqa: E402

# The kernels were defined by whichever module imported them first: skip if that was the other mode.
SAME_TRITON_MODE = pytest.mark.skipif(interpreter.INTERPRETED != INTERPRET,
                                      reason="the kernels were imported in the other Triton mode")
# The one device the kernels run on in this mode; the other is a skipped case.
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="interpreter off")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        INTERPRET, reason="needs CUDA and compiled Triton")]),
]
# The device of the mode, for tests that are not parametrised over DEVICES.
KERNEL_DEVICE = "cpu" if INTERPRET else "cuda"
