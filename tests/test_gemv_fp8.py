"""The FP8 skinny GEMM (`kernels.fused.gemv_fp8`, decode's linears over FP8 weights) against
float64 math over the dequantized weights: every row count 1..16, ragged N and K, both paths,
split K, bias; its launch configs; and `fp8_linear` taking it for few rows.

Without CUDA the kernel runs in Triton's CPU interpreter (the `gpu` variants compile it);
tests/test_fp8_sm90.py compiles it for sm_90 and checks the FMA loop's register layout;
tests/gpu/test_fp8_cuda.py runs it at Llama-3-8B shapes."""

from __future__ import annotations

import pytest
import torch

from tests.triton_modes import DEVICES, INTERPRET, SAME_TRITON_MODE

# isort: split
from lmnb.runtime.kernels.fused import gemv_fp8
from lmnb.runtime.kernels.fused.gemv import SKINNY_MAX_ROWS
from lmnb.runtime.kernels.fused.gemv_fp8 import Fp8GemvConfig, fp8_gemv, fp8_gemv_config
from lmnb.runtime.models.layers import fp8

pytestmark = SAME_TRITON_MODE


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed + 7919 * m + 31 * n + k)
    # rows of very different sizes: a wrong or missing scale shows
    w, scale = fp8.quantize_rows(torch.randn(n, k, generator=gen)
                                 * torch.logspace(-2, 1, n)[:, None])
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    return tuple(t.to(device) for t in (x, w, scale, bias))


def _check(x, w, scale, bias, config: Fp8GemvConfig | None = None) -> None:
    got = fp8_gemv(x, w, scale, bias, config)
    weight = fp8.dequantize_rows(w, scale, torch.float64)
    want = x.double() @ weight.t()
    magnitude = x.double().abs() @ weight.abs().t()  # what the sum's rounding error scales with
    if bias is not None:
        want += bias.double()
        magnitude += bias.double().abs()
    assert got.dtype == x.dtype and got.shape == want.shape
    # float32 sums: ~1e-7 relative to the magnitude; 16-bit x adds the output's rounding (an
    # ulp: the interpreter truncates)
    bound = 1e-5 * magnitude + (0 if x.dtype == torch.float32 else 2**-7 * want.abs())
    error = (got.double() - want).abs()
    assert (error <= bound).all(), f"max error {error.max():.3g}, {(error / bound).max():.3g}x"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_row_count_with_ragged_n_and_k(device, dtype):
    """M = 1..16 (1: the FMA path, 2..16: the dot path over 16 padded rows), N and K odd."""
    n, k = 37, 203
    for m in range(1, SKINNY_MAX_ROWS + 1):
        x, w, scale, bias = _inputs(m, n, k, dtype, device)
        _check(x, w, scale, bias if m % 2 else None)


# The GPU's kinds of config on shapes cut to a few programs (the interpreter runs each in Python):
# (M, N, K) -> config; K ragged against BLOCK_K and the split, N against BLOCK_N.
CONFIGS = {
    "FMA, 4 rows a program": ((1, 11, 2100), Fp8GemvConfig(4, 1024, 1, 4, 1, False)),
    "FMA, 1 row, split K": ((1, 3, 3000), Fp8GemvConfig(1, 1024, 2, 4, 1, False)),
    "FMA, 8 rows, 8 warps, split K 4": ((1, 13, 5000), Fp8GemvConfig(8, 2048, 4, 8, 1, False)),
    "FMA, prefetch, 2 rows": ((1, 5, 2500), Fp8GemvConfig(2, 1024, 1, 4, 2, False)),
    "FMA, prefetch, 2 warps, split K": ((1, 9, 3000), Fp8GemvConfig(4, 512, 2, 2, 2, False)),
    "dot, 64-row tiles": ((5, 70, 520), Fp8GemvConfig(64, 256, 1, 4, 3, True)),
    "dot, 32-row tiles, split K": ((16, 40, 1100), Fp8GemvConfig(32, 256, 2, 4, 4, True)),
    "dot at one row": ((1, 20, 300), Fp8GemvConfig(16, 128, 1, 4, 3, True)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpu_configs(device, dtype, name):
    """16-bit x with K a multiple of 4: the FMA path reads 4 weights an int32, 4 activations an
    int64 (fp32 x: element by element)."""
    (m, n, k), config = CONFIGS[name]
    x, w, scale, bias = _inputs(m, n, k, dtype, device, seed=1)
    _check(x, w, scale, bias, config)
    x, w, scale, _ = _inputs(m, n, config.block_k * config.split_k, dtype, device, seed=2)
    _check(x, w, scale, None, config)  # K a multiple of the blocks: the unmasked loop


LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
             "down": (4096, 14336), "lm_head": (128256, 4096)}


@pytest.mark.parametrize("m", [1, 2, 16])
@pytest.mark.parametrize("shape", list(LLAMA3_8B))
def test_configs_keep_the_fma_layout_and_fill_the_gpu(m, shape):
    """The FMA path's BLOCK_K spans all warps at 8 elements a thread (else Triton shuffles the
    weight through shared memory every step); enough programs for 132 SMs; shared memory of
    the dot path's stages within an H100's 227 KB."""
    n, k = LLAMA3_8B[shape]
    cfg = fp8_gemv_config(m, n, k)
    assert cfg.use_dot == (m > 1)
    programs = -(-n // cfg.block_n) * cfg.split_k
    assert programs >= 128 and k // cfg.split_k >= cfg.block_k  # about one an SM at least
    if cfg.use_dot:
        stage = cfg.block_n * cfg.block_k + 16 * cfg.block_k * 2
        assert stage * cfg.num_stages <= 227 << 10 and cfg.block_n >= 16
    else:
        assert cfg.block_k % (gemv_fp8.FMA_VEC * 32 * cfg.num_warps) == 0
        assert cfg.block_n * cfg.block_k // (32 * cfg.num_warps) <= 64  # weights a thread holds
    for key, tuned in gemv_fp8.TUNED.items():
        assert key[0] in (1, SKINNY_MAX_ROWS) and tuned.use_dot == (key[0] > 1)


def test_rejects_what_it_does_not_take():
    x, w, scale, _ = _inputs(SKINNY_MAX_ROWS + 1, 8, 32, torch.float32, "cpu")
    with pytest.raises(AssertionError, match="rows"):
        fp8_gemv(x, w, scale)
    with pytest.raises(AssertionError, match="e4m3"):
        fp8_gemv(x[:2], w.float(), scale)
    with pytest.raises(AssertionError, match="FMA path takes one row"):
        fp8_gemv(x[:2], w, scale, config=Fp8GemvConfig(4, 1024, 1, 4, 1, False))


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_linear_takes_it_for_few_rows_when_fused(device, monkeypatch):
    calls: list[int] = []
    kernel = gemv_fp8.fp8_gemv

    def counting(x, weight, weight_scale, bias=None, config=None):
        calls.append(x.shape[0])
        return kernel(x, weight, weight_scale, bias, config)

    monkeypatch.setattr(gemv_fp8, "fp8_gemv", counting)
    x, w, scale, bias = _inputs(SKINNY_MAX_ROWS + 1, 24, 40, torch.float32, device)
    def run_rows() -> None:
        for rows in (1, 3, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1):
            out = fp8.fp8_linear(x[:rows].reshape(1, rows, 40), w, scale, bias, fused=True)
            assert out.shape == (1, rows, 24)
        fp8.fp8_linear(x[:2], w, scale, bias, fused=False)

    run_rows()
    assert calls == [1]  # 2+ rows: the W8A8 GEMM over per-token FP8 rows
    calls.clear()
    # weight-only (W8A16) layers: the skinny kernel for one row too, `mm_fp8.w8a16_mm` past it
    # (test_fp8_mm.py), and the layers' decode fusions only where the skinny kernel runs
    for rows in (1, 3, SKINNY_MAX_ROWS):
        fp8.fp8_linear(x[:rows], w, scale, bias, fused=True, weight_only=True)
    assert calls == [1]
    assert fp8.skinny_rows(x[:1]) and not fp8.skinny_rows(x[:3])
    calls.clear()
    monkeypatch.setattr(fp8, "W8A16_MAX_ROWS", SKINNY_MAX_ROWS)
    run_rows()
    assert calls == [1, 3, SKINNY_MAX_ROWS]


# gate_up's weight [gate (I rows) | up (I rows)] with SiLU-and-mul in the epilogue: (M, I, K)
GATED = {
    "FMA, 4 rows = 2 pairs a program": ((1, 11, 2100), Fp8GemvConfig(4, 1024, 1, 4, 1, False)),
    "FMA, 1 row made a pair, split K": ((1, 9, 3000), Fp8GemvConfig(1, 1024, 2, 4, 2, False)),
    "dot, split K": ((16, 40, 1100), Fp8GemvConfig(32, 256, 2, 4, 4, True)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("name", "dtype"), [(name, torch.bfloat16) for name in GATED]
                         + [("dot, split K", torch.float32)])
def test_gated_is_silu_and_mul_of_the_gemm(device, dtype, name):
    """`gated=True` gives what `silu_and_mul(fp8_gemv(...))` gives (two launches), rounded at
    the same places: equal for 16-bit x, up to a sum's order in float32; bias on gate and up;
    ragged I against the pairs a program holds."""
    from lmnb.runtime.kernels.fused import silu_and_mul

    (m, i, k), config = GATED[name]
    x, w, scale, bias = _inputs(m, 2 * i, k, dtype, device, seed=3)
    for b in (None, bias):
        got = fp8_gemv(x, w, scale, b, config, gated=True)
        want = silu_and_mul(fp8_gemv(x, w, scale, b, config))
        assert got.shape == (m, i) and got.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        else:
            assert torch.equal(got, want)


# RMSNorm (+ the residual add) in the prologue: (M, N, K) -> config; K multiple of 4 or not
# (16-bit x: packed or element by element), split K overridden (the norm needs all of K)
NORMED = {
    "FMA, packed": ((1, 12, 2100), Fp8GemvConfig(4, 1024, 1, 4, 1, False)),
    "FMA, packed, prefetch": ((1, 12, 2100), Fp8GemvConfig(2, 512, 1, 2, 2, False)),
    "FMA, packed, prefetch, even K": ((1, 6, 2048), Fp8GemvConfig(2, 512, 1, 2, 2, False)),
    "FMA, element by element, split K asked": ((1, 10, 1001), Fp8GemvConfig(2, 512, 2, 2, 2,
                                                                            False)),
    "dot": ((5, 70, 520), Fp8GemvConfig(64, 256, 1, 4, 3, True)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("name", "dtype"), [(name, torch.bfloat16) for name in NORMED]
                         + [("dot", torch.float32), ("FMA, packed", torch.float16)])
def test_norm_prologue_is_rms_norm_then_the_gemm(device, dtype, name):
    """`fp8_norm_gemv` against `rms_norm` then `fp8_gemv` (gated and not, with and without the
    residual): the residual stream exactly; the output up to the separate norm's two roundings
    of its output (float32: a sum's order)."""
    from lmnb.runtime.kernels.fused import rms_norm, silu_and_mul
    from lmnb.runtime.kernels.fused.gemv_fp8 import RmsNormInput, fp8_norm_gemv

    (m, n, k), config = NORMED[name]
    x, w, scale, bias = _inputs(m, n, k, dtype, device, seed=4)
    gen = torch.Generator().manual_seed(k)
    residual = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    g = (torch.rand(k, generator=gen) + 0.5).to(device=device, dtype=dtype)
    for res, gated in ((None, False), (residual, True), (residual, False)):
        normed, stream = (rms_norm(x, g, 1e-5), x) if res is None else rms_norm(x, g, 1e-5, res)
        want = fp8_gemv(normed, w, scale, bias, config)
        want = silu_and_mul(want) if gated else want
        got, got_stream = fp8_norm_gemv(x, RmsNormInput(res, g, 1e-5), w, scale, bias, config,
                                        gated=gated)
        assert torch.equal(got_stream, stream) and got.shape == want.shape
        tol = 1e-5 if dtype == torch.float32 else 3 * 2**-8
        torch.testing.assert_close(got.float(), want.float(), rtol=tol,
                                   atol=tol * want.abs().max().item())


def _pool(kv_dtype: torch.dtype, kv_heads: int, head_dim: int, device: str,
          fixed_scales: bool = False):
    """K, V buffers [12 slots, kv_heads, head_dim] of 3.0 (and an FP8 pool's scales: 2.0, or
    fixed ones, slot stride 0, 0.05 * (head + 1) for K and 0.02 * (head + 1) for V)."""
    buffers = tuple(torch.full((12, kv_heads, head_dim), 3.0, device=device).to(kv_dtype)
                    for _ in range(2))
    if kv_dtype != torch.float8_e4m3fn:
        return buffers, None
    if fixed_scales:
        heads = torch.arange(1.0, kv_heads + 1, device=device)
        return buffers, tuple((step * heads)[None, :].expand(12, kv_heads) for step in (0.05, 0.02))
    return buffers, tuple(torch.full((12, kv_heads), 2.0, device=device) for _ in range(2))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _same_pools(a, b) -> bool:
    """Bit for bit (FP8 bytes, their scales)."""
    (a_bufs, a_scales), (b_bufs, b_scales) = a, b
    same = all(torch.equal(_bits(x), _bits(y)) for x, y in zip(a_bufs, b_bufs, strict=True))
    return same and (a_scales is None or all(map(torch.equal, a_scales, b_scales)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("m", "config", "kv_dtype", "head_dim", "fixed_scales"), [
    (1, Fp8GemvConfig(16, 256, 2, 1, 1, False), torch.float32, 16, False),  # FMA, packed x
    (1, Fp8GemvConfig(4, 512, 1, 2, 2, False), torch.bfloat16, 16, False),  # FMA, prefetch
    (3, Fp8GemvConfig(32, 128, 1, 4, 3, True), torch.bfloat16, 16, False),  # dot
    # FP8 pools: 4 programs a head (2 rows each); 8 pairs a program over heads of 12 pairs
    (1, Fp8GemvConfig(4, 256, 1, 1, 1, False), torch.float8_e4m3fn, 16, False),
    (3, Fp8GemvConfig(16, 128, 1, 4, 3, True), torch.float8_e4m3fn, 24, False),
    # FP8 pools with fixed scales (slot stride 0), one per KV head
    (1, Fp8GemvConfig(4, 256, 1, 1, 1, False), torch.float8_e4m3fn, 16, True),
    (3, Fp8GemvConfig(16, 128, 1, 4, 3, True), torch.float8_e4m3fn, 24, True),
])
def test_rotary_epilogue_is_rotary_qkv_of_the_gemm(device, m, config, kv_dtype, head_dim,
                                                   fixed_scales):
    """qkv with the norm in front and the neox rotary behind (`rope=`): q and the KV pool's
    rows at the slots equal `rotary_qkv(..., kv_buffers=, slots=)` of the GEMM's output, an FP8
    pool's bytes and per-(token, head) scales too (its heads' pairs spread over programs, or a
    program's over heads), or its bytes under fixed scales; other slots untouched; the residual
    stream the same. Twice, to other slots: the FP8 store's arrival counters are back at zero
    after a launch."""
    from lmnb.runtime.kernels.arrivals import arrival_counters
    from lmnb.runtime.kernels.fused import rotary_qkv
    from lmnb.runtime.kernels.fused.gemv_fp8 import RmsNormInput, RotaryStore, fp8_norm_gemv

    heads, kv_heads, k = 4, 2, 200
    x, w, scale, bias = _inputs(m, (heads + 2 * kv_heads) * head_dim, k, torch.bfloat16, device)
    gen = torch.Generator().manual_seed(m)
    residual = torch.randn(m, k, generator=gen).to(device=device, dtype=torch.bfloat16)
    norm = RmsNormInput(residual, (torch.rand(k, generator=gen) + 0.5).to(x), 1e-5)
    freqs = torch.outer(torch.arange(64.0), 1e4 ** -(torch.arange(0, head_dim, 2) / head_dim))
    cos, sin = (f(torch.cat((freqs, freqs), -1)).to(device) for f in (torch.cos, torch.sin))
    positions = torch.tensor([5, 63, 0][:m], device=device)
    pools = [_pool(kv_dtype, kv_heads, head_dim, device, fixed_scales) for _ in range(2)]
    qkv, stream = fp8_norm_gemv(x, norm, w, scale, bias, config)
    for slots in ([7, 2, 11][:m], [3, 9, 1][:m]):
        slots = torch.tensor(slots, device=device)
        want, _ = rotary_qkv(positions, qkv, cos, sin, num_heads=heads, num_kv_heads=kv_heads,
                             head_dim=head_dim, kv_buffers=pools[0][0], slots=slots,
                             kv_scales=pools[0][1])
        got, got_stream = fp8_norm_gemv(x, norm, w, scale, bias, config, rope=RotaryStore(
            positions, cos, sin, heads, kv_heads, head_dim, *pools[1][0], slots, pools[1][1]))
        assert torch.equal(got, want) and torch.equal(got_stream, stream)
        assert _same_pools(pools[0], pools[1])
    assert not arrival_counters(x.device, 2 * kv_heads).any()
    if fixed_scales:  # against torch: rotated k and v divided by their head's scale
        _, k_rot = rotary_qkv(positions, qkv, cos, sin, num_heads=heads, num_kv_heads=kv_heads,
                              head_dim=head_dim)
        v = qkv[:, (heads + kv_heads) * head_dim:]
        for rows, buffer, scales in zip((k_rot, v), pools[1][0], pools[1][1], strict=True):
            want = (rows.float().view(m, kv_heads, head_dim) / scales[0][None, :, None]).clamp(
                -448, 448).to(torch.float8_e4m3fn).float().cpu()
            got = buffer[slots].float().cpu()
            if INTERPRET:  # the interpreter drops e4m3's carry rounding up to a power of two
                got = torch.where((want.abs().log2() % 1 == 0) & (got == want / 2), want, got)
            assert ((got - want).abs() <= want.abs() * 2**-3 + 2**-9).all()  # an e4m3 step
    if kv_dtype == torch.float8_e4m3fn:
        with pytest.raises(ValueError, match="needs its scales"):
            fp8_norm_gemv(x, norm, w, scale, bias, config, rope=RotaryStore(
                positions, cos, sin, heads, kv_heads, head_dim, *pools[1][0], slots))
