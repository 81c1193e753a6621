"""The weight-only FP8 GEMM (`kernels.fused.mm_fp8`, W8A16 for more than 16 rows) against the
dequantized weight times x; interpreted on the CPU (tiny shapes), compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.triton_modes import DEVICES, SAME_TRITON_MODE

# isort: split
from lmnb.runtime.kernels.fused.mm_fp8 import W8A16Config, w8a16_mm
from lmnb.runtime.models.layers import fp8

pytestmark = SAME_TRITON_MODE


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("m", "n", "k", "dtype", "bias"), [
    (37, 40, 72, torch.float32, True),  # ragged in every dimension (masks)
    (20, 32, 48, torch.bfloat16, False),
])
def test_w8a16_mm_is_the_dequantized_linear(device, m, n, k, dtype, bias):
    gen = torch.Generator().manual_seed(m)
    w, scale = fp8.quantize_rows(torch.randn(n, k, generator=gen))
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    w, scale, x = w.to(device), scale.to(device), x.to(device)
    b = b.to(device) if b is not None else None
    # the weight exact in float32, the sums in float32 on both sides
    want = (x.float() @ fp8.dequantize_rows(w, scale).t()
            + (b.float() if b is not None else 0)).to(dtype)
    cfg = W8A16Config(16, 16, 16, 2, 4, 2) if device == "cuda" else None
    got = w8a16_mm(x, w, scale, b, cfg)
    assert got.dtype == dtype and got.shape == (m, n)
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max())
    assert w8a16_mm(x[:0], w, scale).shape == (0, n)


def test_weight_only_linear_takes_the_kernel_when_fused():
    """`fp8_linear(..., weight_only=True, fused=True)` past the skinny GEMV's rows: this kernel
    (no 16-bit copy of the weight); not fused: F.linear over the dequantized weight."""
    if not torch.cuda.is_available():
        device = "cpu"
    else:
        device = "cuda"
    gen = torch.Generator().manual_seed(1)
    w, scale = fp8.quantize_rows(torch.randn(48, 64, generator=gen))
    x = torch.randn(24, 64, generator=gen)
    w, scale, x = w.to(device), scale.to(device), x.to(device)
    fused = fp8.fp8_linear(x, w, scale, None, fused=True, weight_only=True)
    plain = fp8.fp8_linear(x, w, scale, None, fused=False, weight_only=True)
    assert torch.equal(fused, w8a16_mm(x, w, scale))
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
