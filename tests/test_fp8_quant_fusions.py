"""The W8A8 path's quantization fused into the kernel in front (`rms_norm_quant`,
`silu_and_mul_quant`): the FP8 codes, scales and residual stream bit for bit those of the kernels
apart (`rms_norm` / `silu_and_mul`, then `per_token_quant`), compiled on the GPU or in Triton's
interpreter; and a tiny FP8 model's prefill taking them, with the logits of the ablation
(`linear.FP8_QUANT_FUSIONS` off). tests/gpu/test_fp8_cuda.py serves a model both ways."""

from __future__ import annotations

import random

import pytest
import torch

# tests.triton_modes sets TRITON_INTERPRET: it is imported before any kernel module.
from tests.triton_modes import DEVICES, INTERPRET, SAME_TRITON_MODE

# isort: split
from lmnb.runtime.kernels.fused import activation, fp8_quant, rmsnorm
from lmnb.runtime.models import loader
from lmnb.runtime.models.layers import linear
from lmnb.runtime.models.layers.fusion import set_fused_kernels
from tests.test_fp8 import _bits, _load, _runner
from tests.test_fused_kernels import _passes

pytestmark = SAME_TRITON_MODE


def _rows(m: int, k: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    """Rows of very different sizes (1e-3 .. 1e3), one all zero."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, m)[:, None]
    x[1] = 0
    return x.to(dtype).to(device)


def _same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]
          ) -> None:
    assert torch.equal(_bits(got[0]), _bits(want[0]))  # the FP8 bytes
    assert torch.equal(got[1], want[1]) and got[1].shape == want[1].shape  # float32 [M, 1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [40, 1536])  # a masked block; 8 warps on the GPU
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_quant_is_rms_norm_then_per_token_quant(device, dtype, hidden, with_residual):
    x = _rows(6, hidden, dtype, device, seed=hidden)
    residual = _rows(6, hidden, dtype, device, seed=hidden + 1) if with_residual else None
    weight = (torch.rand(hidden, generator=torch.Generator().manual_seed(0)) + 0.5).to(dtype)
    weight = weight.to(device)
    codes, scale, stream = rmsnorm.rms_norm_quant(x, weight, 1e-5, residual)
    if residual is None:
        normed = rmsnorm.rms_norm(x, weight, 1e-5)
        assert stream is None
    else:
        normed, want_stream = rmsnorm.rms_norm(x, weight, 1e-5, residual)
        assert torch.equal(stream, want_stream)
    _same((codes, scale), fp8_quant.per_token_quant(normed))
    assert (codes[1].float() == 0).all()  # the all-zero row


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("width", "row_block_max"), [(40, activation.ROW_BLOCK_MAX),
                                                      (40, 16), (1536, 512)])
def test_silu_and_mul_quant_is_silu_and_mul_then_per_token_quant(device, dtype, width,
                                                                 row_block_max):
    """One block per row, and the two-pass loop (`row_block_max` lowered) with a ragged end."""
    gate_up = _rows(5, 2 * width, dtype, device, seed=width) / 100
    got = activation.silu_and_mul_quant(gate_up, row_block_max=row_block_max)
    _same(got, fp8_quant.per_token_quant(activation.silu_and_mul(gate_up)))


@pytest.mark.skipif(not INTERPRET, reason="CPU tensors reach Triton through its interpreter")
def test_prefill_quantizes_in_the_norm_and_activation_kernels(tiny_models, monkeypatch):
    """FP8 tiny model (fp32, fused kernels interpreted), a 17-row prefill (W8A8: the reference
    GEMM on the CPU) and a 1-row decode (the skinny GEMMs): the prefill's qkv and gate_up take
    their rows from `rms_norm_quant`, down_proj from `silu_and_mul_quant`, only o_proj's input is
    quantized by `per_token_quant`; the logits (and so the greedy tokens) equal the ablation's,
    which quantizes each GEMM's input apart."""
    folder = tiny_models["llama-gqa"]
    config = loader.load_model_config(folder)
    with pytest.warns(UserWarning, match="reference path"):
        model = _load(folder, config.quantized("fp8"))
    set_fused_kernels(model, True)
    runner = _runner(model, config)
    calls: list[str] = []
    for module, name in ((rmsnorm, "rms_norm_quant"), (activation, "silu_and_mul_quant"),
                         (fp8_quant, "per_token_quant")):
        op = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _op=op, _name=name, **k: (
            calls.append(_name), _op(*a, **k))[1])
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (17,)]
    next_ids = [rng.randrange(3, 49152) for _ in prompts]
    fused = _passes(runner, prompts, next_ids)
    layers = config.num_layers
    assert sorted(calls) == sorted(["rms_norm_quant"] * 2 * layers
                                   + ["silu_and_mul_quant", "per_token_quant"] * layers)
    monkeypatch.setattr(linear, "FP8_QUANT_FUSIONS", False)  # the ablation switch
    calls.clear()
    apart = _passes(runner, prompts, next_ids)
    assert calls == ["per_token_quant"] * 4 * layers
    for f, a in zip(fused, apart, strict=True):
        assert torch.equal(f, a)
    assert torch.equal(fused[0].argmax(-1), apart[0].argmax(-1))
