"""The skinny-GEMM kernel (decode's linear layers) against F.linear, each branch of its config
heuristic, the linear layers' switch to it, and a tiny model's greedy tokens with it on and off.

Without CUDA the kernel runs in Triton's CPU interpreter on CPU tensors; with CUDA it is compiled
(the `gpu` variants). Triton decides at decoration time, so the variable is set before import.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tests.triton_modes import DEVICES, KERNEL_DEVICE, SAME_TRITON_MODE

# isort: split
from lmnb.runtime.kernels.fused import gemv
from lmnb.runtime.kernels.fused.gemv import (
    SKINNY_MAX_ROWS,
    SkinnyConfig,
    skinny_config,
    skinny_linear,
)
from lmnb.runtime.models.layers import linear as linear_layers
from lmnb.runtime.models.layers.linear import (
    LogitsProjection,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)

pytestmark = SAME_TRITON_MODE
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           config: SkinnyConfig | None = None) -> None:
    got = skinny_linear(x, weight, bias, config)
    want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert got.dtype == x.dtype and got.shape == want.shape
    # fp32: the order of a sum; fp16/bf16: the output's rounding (half an ulp) plus that.
    scale = want.abs().max().item() + 1.0
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[x.dtype]
    error = (got.double() - want).abs().max().item()
    assert error <= tol * scale, f"max error {error:.3g} (scale {scale:.3g})"


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, device: str, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed + m * 7919 + n * 31 + k)
    x = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    weight = (torch.randn(n, k, generator=gen) / k ** 0.5).to(device=device, dtype=dtype)
    b = torch.randn(n, generator=gen).to(device=device, dtype=dtype) if bias else None
    return x, weight, b


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 5, 37), (1, 96, 64), (2, 33, 100), (5, 70, 300),
                                           (SKINNY_MAX_ROWS, 48, 200)])
def test_matches_f_linear(device, dtype, m, n, k):
    x, weight, bias = _inputs(m, n, k, dtype, device, bias=True)
    _check(x, weight, bias)
    _check(x, weight, None)


@pytest.mark.parametrize("device", DEVICES)
def test_reads_strided_rows(device):
    wide = torch.randn(3, 200, device=device)
    weight = torch.randn(24, 64, device=device)
    _check(wide[:, :64], weight, None)


# Llama shapes (M, N, K) -> the heuristic's branch; each config then runs on N and K cut to two
# blocks a program (and a ragged one more): the interpreter runs each program in Python.
BRANCHES = {
    "M=1: one-row FMA programs": ((1, 22016, 4096), SkinnyConfig(1, 1024, 1, 4, 4, False)),
    "M=1, small N: split K": ((1, 128, 8192), SkinnyConfig(1, 1024, 2, 4, 4, False)),
    "M=8: 32-row dot tiles": ((8, 12288, 4096), SkinnyConfig(32, 256, 1, 4, 5, True)),
    "M=16, small N: dot, split K": ((16, 1024, 11008), SkinnyConfig(32, 256, 8, 4, 5, True)),
}


@pytest.mark.parametrize("branch", list(BRANCHES))
def test_heuristic_branches(branch):
    (m, n, k), want = BRANCHES[branch]
    assert skinny_config(m, n, k, torch.float16) == want
    fp32 = skinny_config(m, n, k, torch.float32)  # same bytes a tile: half the K
    assert fp32.block_k == want.block_k // 2 and fp32.block_n == want.block_n


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("branch", list(BRANCHES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_each_branch_config_runs(device, branch, dtype):
    (m, _, _), config = BRANCHES[branch]
    if dtype == torch.float32:
        config = config._replace(block_k=config.block_k // 2)
    n = 2 * config.block_n + 3  # ragged last block
    k = 2 * config.split_k * config.block_k  # two tiles a slice
    x, weight, bias = _inputs(m, n, k + 5, dtype, device, bias=True)  # ragged K as well
    _check(x, weight, bias, config)
    x, weight, _ = _inputs(m, n, k, dtype, device, bias=False)  # K a multiple of the blocks
    _check(x, weight, None, config)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", [2, 3, 4])
def test_fma_path_takes_a_few_rows(device, m):
    """Not chosen by the heuristic, but in the benchmark's sweep: the FMA path over M <= 4 rows."""
    x, weight, bias = _inputs(m, 37, 300, torch.float32, device, bias=True)
    _check(x, weight, bias, SkinnyConfig(8, 64, 2, 4, 1, False))


def test_the_layers_row_limit_is_the_kernels():
    assert linear_layers.SKINNY_MAX_ROWS == SKINNY_MAX_ROWS


def test_rejects_what_it_does_not_take():
    x = torch.randn(SKINNY_MAX_ROWS + 1, 8)
    with pytest.raises(AssertionError, match="rows"):
        skinny_linear(x, torch.randn(4, 8))
    with pytest.raises(AssertionError, match="contiguous"):
        skinny_linear(x[:2], torch.randn(8, 4).t())


# ---- the layers' switch --------------------------------------------------------------------

@pytest.fixture
def skinny_calls(monkeypatch) -> list[int]:
    """Counts the rows of every skinny_linear call the layers make."""
    calls: list[int] = []
    kernel = gemv.skinny_linear

    def counting(x, weight, bias=None, config=None):
        calls.append(x.shape[0])
        return kernel(x, weight, bias, config)

    monkeypatch.setattr(gemv, "skinny_linear", counting)
    return calls


@pytest.mark.parametrize("device", DEVICES)
def test_linear_layers_take_the_kernel_for_few_rows(device, skinny_calls):
    torch.manual_seed(0)
    layers = [QKVParallelLinear(32, head_dim=8, num_heads=4, num_kv_heads=2, bias=True),
              MergedColumnParallelLinear.even(32, [24, 24], bias=False),
              RowParallelLinear(32, 40, bias=True)]
    for layer in layers:
        layer.to(device)
        for rows in (1, 3, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1):
            x = torch.randn(rows, 32, device=device)
            layer.fused = False
            want = layer(x)
            layer.fused = True
            got = layer(x)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        x = torch.randn(2, 3, 32, device=device)  # [..., K] keeps its leading shape
        assert layer(x).shape == (2, 3, layer.out_features)
    assert skinny_calls == [1, 3, SKINNY_MAX_ROWS, 6] * len(layers)

    head = LogitsProjection().to(device)
    weight = torch.randn(100, 32, device=device)
    hidden = torch.randn(2, 32, device=device)
    head.fused = True
    torch.testing.assert_close(head(hidden, weight), hidden @ weight.t(), atol=1e-5, rtol=1e-5)
    assert skinny_calls[-1] == 2


def test_a_fused_tiny_model_decodes_the_same_greedy_tokens(tiny_models, monkeypatch,
                                                            skinny_calls):
    """fp32, a batch of three requests through the decode path: fused kernels (the skinny
    linears and LM head included) against the torch path."""
    from lmnb.runtime import builder
    from lmnb.runtime.engine import Runtime

    device = KERNEL_DEVICE
    monkeypatch.setattr(builder, "fused_kernels_available", lambda device: True)
    prompts = ["The capital of France is", "1, 2, 3,", "Once upon a time"]
    params = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    outputs = {}
    for fused in (True, False):
        with Runtime(tiny_models["qwen2-bias"], device=device, dtype="float32",
                     max_total_tokens=256,
                     disable_fused_kernels=not fused) as rt:  # CUDA: graphs captured
            assert rt.stats()["fused_kernels"] is fused
            outputs[fused] = [o["output_ids"] for o in rt.generate(prompts, params)]
    assert outputs[True] == outputs[False]
    assert all(len(ids) == 4 for ids in outputs[True])
    assert skinny_calls and 3 in skinny_calls, "the decode steps took the skinny kernel"
