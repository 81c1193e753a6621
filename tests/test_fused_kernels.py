"""Fused Triton kernels (RMSNorm + residual, SiLU-and-mul, rotary q/k + KV store) against the torch
path of their layers, and whole models with the kernels on against the torch path.

Without CUDA the kernels run in Triton's CPU interpreter on CPU tensors (small shapes); with CUDA
they are compiled and run on the GPU. tests/triton_modes.py picks the mode.
"""

from __future__ import annotations

import random

import pytest
import torch

# tests.triton_modes sets TRITON_INTERPRET: it is imported before any kernel module.
from tests.sm90 import assert_compiles_for_sm90
from tests.triton_modes import DEVICES, INTERPRET, KERNEL_DEVICE, SAME_TRITON_MODE

# isort: split
from lmnb.runtime.config import EngineConfig, ModelConfig
from lmnb.runtime.core import Batch, ForwardMode
from lmnb.runtime.kernels.fused import rms_norm, rotary_qkv, silu_and_mul
from lmnb.runtime.memory import KVAllocator
from lmnb.runtime.model_runner import ModelRunner
from lmnb.runtime.models import loader
from lmnb.runtime.models.layers.activation import GatedActivation
from lmnb.runtime.models.layers.fusion import (
    fused_kernels_available,
    fused_kernels_enabled,
    set_fused_kernels,
)
from lmnb.runtime.models.layers.norm import RMSNorm
from lmnb.runtime.models.layers.rotary import RotaryEmbedding

pytestmark = SAME_TRITON_MODE

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The kernels round where the torch path rounds; what is left is the order of a sum and, for
# the rotary, torch's cos/sin rounded to the model dtype: about one unit in the last place.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "hidden"), [(1, 64), (7, 96), (33, 4096)])
def test_rms_norm_with_and_without_residual(device, dtype, tokens, hidden):
    gen = torch.Generator().manual_seed(tokens + hidden)
    norm = RMSNorm(hidden, 1e-5).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=gen) + 0.5)
    x = (torch.randn(tokens, hidden, generator=gen) * 3).to(device=device, dtype=dtype)
    residual = torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=dtype)
    x_copy, residual_copy = x.clone(), residual.clone()

    want = norm(x)
    want_normed, want_residual = norm(x, residual)
    got = rms_norm(x, norm.weight, norm.eps)
    got_normed, got_residual = rms_norm(x, norm.weight, norm.eps, residual)
    _close(got, want, dtype)
    _close(got_residual, want_residual, dtype)
    _close(got_normed, want_normed, dtype)
    assert torch.equal(x, x_copy) and torch.equal(residual, residual_copy), "inputs kept"

    norm.fused = True  # the layer's switch takes the kernel
    _close(norm(x, residual)[0], want_normed, dtype)


def test_rms_norm_reads_strided_rows():
    wide = torch.randn(5, 200, device=KERNEL_DEVICE)
    x = wide[:, :64]  # row stride 200
    weight = torch.rand(64, device=x.device)
    norm = RMSNorm(64, 1e-6).to(x.device)
    with torch.no_grad():
        norm.weight.copy_(weight)
    _close(rms_norm(x, weight, 1e-6), norm(x), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "width"), [(1, 64), (5, 300), (3, 2500)])
def test_silu_and_mul(device, dtype, tokens, width):
    gen = torch.Generator().manual_seed(tokens * width)
    gate_up = (torch.randn(tokens, 2 * width, generator=gen) * 4).to(device=device, dtype=dtype)
    act = GatedActivation("silu")
    want = act(gate_up)
    _close(silu_and_mul(gate_up), want, dtype)
    act.fused = True
    _close(act(gate_up), want, dtype)


def test_gated_activation_without_a_kernel_keeps_the_torch_path():
    act = GatedActivation("gelu_pytorch_tanh")
    act.fused = True
    x = torch.randn(3, 8)
    want = torch.nn.functional.gelu(x[:, :4], approximate="tanh") * x[:, 4:]
    torch.testing.assert_close(act(x), want)


def _rope_config(head_dim: int, heads: int, kv_heads: int, scaled: bool) -> ModelConfig:
    scaling = ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
               if scaled else None)
    return ModelConfig(architecture=None, model_type="llama", num_layers=1,
                       hidden_size=heads * head_dim, intermediate_size=8, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=8,
                       max_position_embeddings=2048, rope_theta=500000.0 if scaled else 1e4,
                       rope_scaling=scaling)


ROPE_SHAPES = [(4, 4, 64), (8, 2, 128), (8, 1, 64), (6, 2, 80)]  # GQA 1/4/8, odd head_dim/2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), ROPE_SHAPES)
@pytest.mark.parametrize("tokens", [1, 13])
def test_rotary_qkv_matches_the_torch_rotary(device, dtype, heads, kv_heads, head_dim, tokens):
    gen = torch.Generator().manual_seed(heads * head_dim + tokens)
    config = _rope_config(head_dim, heads, kv_heads, scaled=kv_heads == 2)
    rotary = RotaryEmbedding(config).to(device)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width, generator=gen).to(device=device, dtype=dtype)
    positions = torch.randint(0, 2048, (tokens,), generator=gen).to(device)
    want_q, want_k, want_v = rotary.rotate_qkv(positions, qkv, num_heads=heads,
                                               num_kv_heads=kv_heads)

    got_q, got_k = rotary_qkv(positions, qkv, rotary.cos, rotary.sin, num_heads=heads,
                              num_kv_heads=kv_heads, head_dim=head_dim)
    _close(got_q, want_q.contiguous(), dtype)
    _close(got_k, want_k.contiguous(), dtype)
    assert got_q.is_contiguous() and got_k.is_contiguous()

    # Stored variant: k and v land in the slots' rows, every other row stays as it was.
    slots = (torch.randperm(40, generator=gen)[:tokens] + 1).to(device)
    k_buffer = torch.full((41, kv_heads, head_dim), 7.0, dtype=dtype, device=device)
    v_buffer = torch.full_like(k_buffer, 7.0)
    q_stored, k_none = rotary_qkv(positions, qkv, rotary.cos, rotary.sin, num_heads=heads,
                                  num_kv_heads=kv_heads, head_dim=head_dim,
                                  kv_buffers=(k_buffer, v_buffer), slots=slots)
    assert k_none is None
    assert torch.equal(q_stored, got_q)
    assert torch.equal(k_buffer[slots].reshape(tokens, -1), got_k)
    assert torch.equal(v_buffer[slots].reshape(tokens, -1), want_v)
    untouched = torch.ones(41, dtype=torch.bool, device=device)
    untouched[slots] = False
    assert (k_buffer[untouched] == 7.0).all() and (v_buffer[untouched] == 7.0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_kernels_accept_empty_batches(device):
    qkv = torch.empty(0, 3 * 64, device=device)
    rotary = RotaryEmbedding(_rope_config(64, 1, 1, scaled=False)).to(device)
    q, k = rotary_qkv(torch.empty(0, dtype=torch.int64, device=device), qkv, rotary.cos,
                      rotary.sin, num_heads=1, num_kv_heads=1, head_dim=64)
    assert q.shape == (0, 64) and k.shape == (0, 64)
    assert silu_and_mul(torch.empty(0, 8, device=device)).shape == (0, 4)
    assert rms_norm(torch.empty(0, 8, device=device), torch.ones(8, device=device), 1e-6).shape \
        == (0, 8)


def test_the_switch_sets_every_fusable_layer(tiny_models):
    folder = tiny_models["llama-gqa"]
    config = loader.load_model_config(folder)
    model = loader.load_model(folder, config, dtype=torch.float32, device=torch.device("cpu"))
    assert not fused_kernels_enabled(model)  # the torch path unless asked
    # norms, activations, rotary, linears (qkv, o, gate_up, down), logits projection
    layers = 2 * config.num_layers + 1 + config.num_layers + 1 + 4 * config.num_layers + 1
    assert set_fused_kernels(model, True) == layers
    assert fused_kernels_enabled(model)
    set_fused_kernels(model, False)
    assert not fused_kernels_enabled(model)
    assert not fused_kernels_available(torch.device("cpu"))


def test_the_engine_turns_them_on_for_cuda_unless_disabled(tiny_models):
    from lmnb.runtime.engine import Runtime

    with pytest.raises(ValueError, match="disable_fused_kernels"):
        EngineConfig(disable_fused_kernels="no")
    device = KERNEL_DEVICE
    folder = tiny_models["llama-gqa"]
    with Runtime(folder, device=device, max_total_tokens=256) as rt:
        assert rt.stats()["fused_kernels"] is (device == "cuda")
    with Runtime(folder, device=device, max_total_tokens=256, disable_fused_kernels=True) as rt:
        assert rt.stats()["fused_kernels"] is False


# ---- code generation for a real GPU, without one -------------------------------------------

_COMPILE_FOR_HOPPER = """
from functools import partial
from lmnb.runtime.kernels.fused import activation, rmsnorm, rope

compile = partial(compile, warps=8)
for dt in ("fp16", "bf16", "fp32"):
    compile(rmsnorm._rms_norm_kernel,
            {**{n: "*" + dt for n in ("X", "RES", "W", "OUT", "RES_OUT")},
             **{n: "i32" for n in ("stride_x", "stride_res", "stride_out", "stride_res_out",
                                   "hidden")}, "eps": "fp32"},
            {"HAS_RESIDUAL": True, "BLOCK": 4096})
    compile(activation._silu_and_mul_kernel,
            {"X": "*" + dt, "OUT": "*" + dt, "stride_x": "i32", "stride_out": "i32",
             "width": "i32"}, {"BLOCK": 1024})
    for store in (True, False):
        compile(rope._rotary_qkv_kernel,
                {**{n: "*" + dt for n in ("QKV", "Q_OUT", "K_OUT", "V_OUT")},
                 "POS": "*i64", "SLOTS": "*i64", "COS": "*fp32", "SIN": "*fp32",
                 "K_SCALE": "*i64", "V_SCALE": "*i64",
                 **{n: "i32" for n in ("stride_qkv", "stride_cos", "stride_sin", "stride_q_out",
                                       "stride_k_row", "stride_k_head", "stride_v_row",
                                       "stride_v_head", "stride_st", "stride_sh", "num_heads",
                                       "num_kv_heads")}},
                {"HEAD_DIM": 128, "HALF": 64, "BLOCK_HALF": 64, "BLOCK_H": 32, "BLOCK_KV": 8,
                 "STORE_KV": store, "KV_FP8": False, "FIXED_SCALES": False,
                 "FP8_MAX": 448.0})
print("compiled")
"""


@pytest.mark.skipif(not INTERPRET, reason="on a GPU the other tests compile the kernels")
def test_kernels_compile_for_a_hopper_gpu():
    """The interpreter does not run Triton's code generation: compile each kernel for sm_90
    ahead of time (no GPU needed; Triton ships ptxas) in a process without TRITON_INTERPRET."""
    assert_compiles_for_sm90(_COMPILE_FOR_HOPPER)


# ---- whole models: fused kernels against the torch path ------------------------------------

def _passes(runner: ModelRunner, prompts: list[list[int]], next_ids: list[int]
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a ragged prefill of `prompts` (every token) and of one decode step after it."""
    model = runner.model
    device = runner.device
    pool_indices = list(range(len(prompts)))
    lens = [len(ids) for ids in prompts]
    slots = KVAllocator(runner.max_total_tokens, device).alloc(sum(lens) + len(prompts))
    table = runner.req_to_token_pool.req_to_token
    start = 0
    for row, n in enumerate(lens):
        table[row, :n] = slots[start:start + n]
        table[row, n] = slots[sum(lens) + row]
        start += n
    extend = Batch(mode=ForwardMode.EXTEND, rids=pool_indices, req_pool_indices=pool_indices,
                   prefix_lens=[0] * len(prompts), extend_lens=lens,
                   input_ids=[t for ids in prompts for t in ids],
                   out_cache_loc=slots[:sum(lens)], samples=[False] * len(prompts))
    decode = Batch(mode=ForwardMode.DECODE, rids=pool_indices, req_pool_indices=pool_indices,
                   prefix_lens=lens, extend_lens=[1] * len(prompts), input_ids=next_ids,
                   out_cache_loc=slots[sum(lens):], samples=[True] * len(prompts))
    logits = []
    with torch.inference_mode():
        for batch in (extend, decode):
            forward_batch = runner.forward_batch(batch)
            runner.attn_backend.init_forward_metadata(forward_batch)
            hidden = model(forward_batch.input_ids, forward_batch.positions, forward_batch)
            logits.append(model.compute_logits(hidden))
    return logits[0], logits[1]


def _whole_model_case(folder, backend: str, device: str, dtype: torch.dtype) -> None:
    config = loader.load_model_config(folder)
    model = loader.load_model(folder, config, dtype=dtype, device=torch.device(device))
    runner = ModelRunner(model, config, EngineConfig(max_total_tokens=256, max_running_requests=4,
                                                     attention_backend=backend),
                         device=torch.device(device), dtype=dtype, eos_token_ids={2})
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (1, 17, 6)]
    next_ids = [rng.randrange(3, 49152) for _ in prompts]
    want = _passes(runner, prompts, next_ids)
    set_fused_kernels(model, True)
    got = _passes(runner, prompts, next_ids)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for g, w in zip(got, want, strict=True):
        relative = (g - w).abs().max() / w.abs().max()
        assert relative < tol, f"relative logit error {relative:.2e}"


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias", "llama3-rope"])
def test_whole_model_fused_equals_torch_path(tiny_models, variant):
    device = KERNEL_DEVICE
    _whole_model_case(tiny_models[variant], "torch_native", device, torch.float32)


def test_whole_model_fused_through_the_triton_backend(tiny_models):
    device = KERNEL_DEVICE
    _whole_model_case(tiny_models["llama-mha"], "triton", device, torch.float32)
