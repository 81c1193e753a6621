"""The FP8-weight GEMMs for more than 16 rows (`kernels.fused.mm_fp8`): W8A16 against the
dequantized weight times x, W8A8 against float32 sums of the FP8 rows and weights (and on a GPU
`torch._scaled_mm`); interpreted on the CPU (tiny shapes), compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.triton_modes import DEVICES, SAME_TRITON_MODE

# isort: split
from lmnb.runtime.kernels.fused.mm_fp8 import W8A16Config, w8a8_mm, w8a16_mm
from lmnb.runtime.models.layers import fp8

pytestmark = SAME_TRITON_MODE


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("m", "n", "k", "dtype", "bias", "split_k"), [
    (37, 40, 72, torch.float32, True, 1),  # ragged in every dimension (masks)
    (20, 32, 48, torch.bfloat16, False, 1),
    (5, 40, 72, torch.bfloat16, True, 3),  # K slices of 32, 32 and 8 columns, then the sum
])
def test_w8a16_mm_is_the_dequantized_linear(device, m, n, k, dtype, bias, split_k):
    gen = torch.Generator().manual_seed(m)
    w, scale = fp8.quantize_rows(torch.randn(n, k, generator=gen))
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    w, scale, x = w.to(device), scale.to(device), x.to(device)
    b = b.to(device) if b is not None else None
    # the weight exact in float32, the sums in float32 on both sides
    want = (x.float() @ fp8.dequantize_rows(w, scale).t()
            + (b.float() if b is not None else 0)).to(dtype)
    cfg = (W8A16Config(16, 16, 16, 2, 4, 2, split_k) if device == "cuda" else
           W8A16Config(16, 16, 32 if split_k > 1 else 16, 2, 1, 1, split_k))
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("m", "n", "k", "bias", "out_dtype", "split_k", "swap_ab"), [
    (37, 40, 72, True, torch.bfloat16, 1, False),  # ragged in every dimension, K not a tile
    (20, 64, 64, False, torch.float32, 1, False),
    (5, 40, 72, True, torch.bfloat16, 3, False),  # K slices of 32, 32 and 8 columns, summed
    (3, 64, 128, False, torch.float32, 2, True),
    (7, 40, 72, True, torch.bfloat16, 1, True),
])
def test_w8a8_mm_is_the_float32_sum_of_fp8_rows_and_weights(device, m, n, k, bias, out_dtype,
                                                             split_k, swap_ab):
    gen = torch.Generator().manual_seed(m)
    w, w_scale = fp8.quantize_rows(torch.randn(n, k, generator=gen))
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 2, m)[:, None]
    codes, scale = fp8.quantize_tokens(x)
    b = torch.randn(n, generator=gen) if bias else None
    want = (codes.float() @ w.float().t()) * scale.reshape(-1, 1) * w_scale[None, :]
    want = want + (b if b is not None else 0)
    codes, scale, w, w_scale = (t.to(device) for t in (codes, scale, w, w_scale))
    b = b.to(device) if b is not None else None
    cfg = (W8A16Config(16, 64 if swap_ab else 32, 32, 2, 4, 2, split_k, swap_ab)
           if device == "cuda" else W8A16Config(16, 32, 32, 2, 1, 1, split_k, swap_ab))
    got = w8a8_mm(codes, scale, w, w_scale, b, out_dtype, cfg)
    assert got.dtype == out_dtype and got.shape == (m, n)
    # float32 out: the float32 sum, but swapped onto sm_90's FP8 wgmma, whose adder is narrower
    # inside each K tile (`test_w8a8_mm_sums_a_long_k_in_float32`), 2^-11
    tol = (2**-7 if out_dtype == torch.bfloat16 else
           2**-11 if swap_ab and device == "cuda" else 1e-5)
    _assert_rows_close(got.float().cpu(), want, tol)
    if device == "cuda" and k % 16 == 0 and n % 16 == 0:  # _scaled_mm's own shapes
        theirs = torch._scaled_mm(codes, w.t(), scale_a=scale.reshape(-1, 1),
                                  scale_b=w_scale.view(1, -1), out_dtype=torch.bfloat16)
        theirs = theirs.float() + (b if b is not None else 0)
        mine = w8a8_mm(codes, scale, w, w_scale, b, torch.bfloat16)  # the default config
        _assert_rows_close(mine.float(), theirs, 2**-7)
    assert w8a8_mm(codes[:0], scale[:0], w, w_scale, None, out_dtype).shape == (0, n)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="sm_90's FP8 MMA accumulation")
@pytest.mark.parametrize("m", [4, 64, 234])
def test_w8a8_mm_sums_a_long_k_in_float32(m):
    """Down_proj's K (14,336): FP8 products are exact in float32. sm_90's FP8 MMAs add in a
    narrower adder; promoted to the float32 sum every K tile the output is within ~2e-4 of each
    row's largest value (H200: as `_scaled_mm` without fast accumulation), left to sum the whole
    K there ~1e-2 (as `_scaled_mm(use_fast_accum=True)`). At 4 rows (decode) K split in slices
    summed in float32 (`w8a8_config`)."""
    gen = torch.Generator().manual_seed(m)
    n, k = 256, 14336
    w, w_scale = fp8.quantize_rows(torch.randn(n, k, generator=gen))
    codes, scale = fp8.quantize_tokens(torch.randn(m, k, generator=gen) + 0.5)
    want = (codes.double() @ w.double().t()) * scale.double().reshape(-1, 1) * w_scale.double()
    got = w8a8_mm(codes.cuda(), scale.cuda(), w.cuda(), w_scale.cuda(), None, torch.float32)
    _assert_rows_close(got.double().cpu(), want, 2**-11)


def _assert_rows_close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """Within tol of each row's largest value (the rows' scales span 1e4)."""
    assert ((got - want).abs() <= tol * want.abs().amax(1, keepdim=True)).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the W8A8 GEMMs' CUDA dispatch")
def test_rows_linear_takes_the_triton_gemm_up_to_its_rows(monkeypatch):
    """`fp8_rows_linear` on CUDA: `w8a8_mm` where `takes_triton_w8a8`, `_scaled_mm` elsewhere;
    the two agree within bf16 rounding."""
    gen = torch.Generator().manual_seed(3)
    w, w_scale = (t.cuda() for t in fp8.quantize_rows(torch.randn(256, 512, generator=gen)))
    codes, scale = (t.cuda() for t in fp8.quantize_tokens(torch.randn(40, 512, generator=gen)))
    rows = fp8.Fp8Rows(codes, scale, torch.bfloat16)
    triton_out = fp8.fp8_rows_linear(rows, w, w_scale, None)
    assert torch.equal(triton_out, w8a8_mm(codes, scale, w, w_scale, None, torch.bfloat16))
    monkeypatch.setattr(fp8, "W8A8_TRITON_MAX_ROWS", 39)
    monkeypatch.setattr(fp8, "W8A8_TRITON_SPARSE_GRID_MAX_ROWS", 39)
    cublas_out = fp8.fp8_rows_linear(rows, w, w_scale, None)
    assert torch.equal(cublas_out, torch._scaled_mm(codes, w.t(), scale_a=scale,
                                                    scale_b=w_scale.view(1, -1),
                                                    out_dtype=torch.bfloat16))
    _assert_rows_close(triton_out.float(), cublas_out.float(), 2**-7)


def test_the_triton_w8a8_gemm_takes_decode_rows_and_narrow_weights_to_128_rows():
    """Up to 64 rows every weight; at 65-128 rows only a weight whose 128 x 128 tiles would
    leave more than half the SMs idle (Llama-3-8B's qkv, o and down on 132 SMs, not gate_up);
    past 128 rows none."""
    columns = {"qkv": 6144, "o": 4096, "gate_up": 28672, "down": 4096}
    takes = {rows: {op for op, n in columns.items() if fp8.takes_triton_w8a8(rows, n, 132)}
             for rows in (17, 64, 65, 128, 129, 234)}
    assert takes[17] == takes[64] == set(columns)
    assert takes[65] == takes[128] == {"qkv", "o", "down"}
    assert takes[129] == takes[234] == set()
    assert not fp8.takes_triton_w8a8(100, 6144, 64)  # 96 tiles: more than half of 64 SMs


@pytest.mark.parametrize(("swap_ab", "splits"), [
    (False, {"qkv": 4, "o": 4, "gate_up": 1, "down": 4}),  # 64 x 128 tiles, 1.5 programs an SM
    (True, {"qkv": 2, "o": 2, "gate_up": 1, "down": 4}),  # 64 x 256: slices of 8+ K steps
])
def test_decode_rows_split_k_until_the_sms_are_busy(monkeypatch, swap_ab, splits):
    """`w8a8_config` at 2-16 rows on 132 SMs (the H200's sweep picks) for Llama-3-8B's linears;
    17+ rows keep 64-row tiles whole."""
    from lmnb.runtime.kernels.fused import mm_fp8

    monkeypatch.setattr(mm_fp8, "INTERPRETED", False)  # the GPU's rule, not the interpreter's
    monkeypatch.setattr(mm_fp8, "W8A8_DECODE_SWAP_AB", swap_ab)
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
              "down": (4096, 14336)}
    for op, (n, k) in shapes.items():
        for m in (2, 16):
            cfg = mm_fp8.w8a8_config(m, n, k, 132)
            assert (cfg.block_m, cfg.swap_ab, cfg.split_k) == (16, swap_ab, splits[op]), op
        assert mm_fp8.w8a8_config(17, n, k, 132).split_k == 1


@pytest.mark.parametrize("device", DEVICES)
def test_weight_only_rows_past_one_take_the_w8a16_gemm(device, monkeypatch):
    """Fused weight-only (W8A16) FP8 linears: one row the skinny kernel, 2+ rows (decode's 2-16
    on the split-K tiles) `mm_fp8.w8a16_mm` over the 16-bit rows, none quantized per token;
    the outputs are x @ the dequantized weight. W8A8 layers quantize 2+ rows."""
    from lmnb.runtime.kernels.fused import gemv_fp8, mm_fp8

    gen = torch.Generator().manual_seed(4)
    w, scale = (t.to(device) for t in fp8.quantize_rows(torch.randn(48, 64, generator=gen)))
    x = torch.randn(17, 64, generator=gen).to(device)
    calls: list[tuple[str, int]] = []
    for module, name in ((mm_fp8, "w8a16_mm"), (gemv_fp8, "fp8_gemv")):
        op = getattr(module, name)
        monkeypatch.setattr(module, name, lambda x, *a, op=op, name=name, **k: (
            calls.append((name, x.shape[0])), op(x, *a, **k))[1])
    for rows in (1, 3, 16, 17):
        got = fp8.fp8_linear(x[:rows], w, scale, None, fused=True, weight_only=True)
        torch.testing.assert_close(got, x[:rows] @ fp8.dequantize_rows(w, scale).t(),
                                   rtol=1e-4, atol=1e-4)
        assert not fp8.quantizes_tokens(rows, w, x.device, fused=True, weight_only=True)
    assert fp8.quantizes_tokens(3, w, x.device, fused=True, weight_only=False)
    assert calls == [("fp8_gemv", 1), ("w8a16_mm", 3), ("w8a16_mm", 16), ("w8a16_mm", 17)]
