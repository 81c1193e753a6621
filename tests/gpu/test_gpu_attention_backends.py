"""GPU attention backends against the float64 per-request reference on random ragged batches
(compiled kernels on the device; the CPU tests cover torch-native and the Triton interpreter),
and whole models through each backend, CUDA graphs included."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from lmnb.runtime.core import ForwardMode
from lmnb.runtime.engine import Runtime
from lmnb.runtime.kernels.registry import attention_backend_class
from lmnb.runtime.memory import KVStorage, ReqToTokenPool
from tests.test_attention_backend import POOL_SIZE, _case, _reference, _run

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BACKENDS = [pytest.param(name, marks=pytest.mark.skipif(
    importlib.util.find_spec(package) is None, reason=f"{package} is not installed"))
    for name, package in (("flashinfer", "flashinfer"), ("triton", "triton"))]
SHAPES = [(8, 8, 64), (8, 2, 128), (32, 4, 128), (16, 2, 64)]  # GQA ratios 1, 4, 8, 8


def _gpu_backend(name: str, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    device = torch.device("cuda")
    return attention_backend_class(name)(
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        req_to_token_pool=ReqToTokenPool(32, 2304, device),
        kv_storage=KVStorage(POOL_SIZE * 16, num_layers=1, kv_heads=kv_heads, head_dim=head_dim,
                             dtype=dtype, device=device))


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES)
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_backend_matches_reference_on_ragged_batches(name, heads, kv_heads, head_dim, mode):
    if name == "flashinfer" and head_dim not in (64, 128):
        pytest.skip("flashinfer head dims")
    backend = _gpu_backend(name, heads, kv_heads, head_dim, torch.bfloat16)
    rng = random.Random(heads + head_dim)
    for bs in (1, 5, 16):
        case = _case(backend, rng, mode=mode, bs=bs, max_prefix=2000, max_extend=300)
        case.k, case.v = case.k.bfloat16().float(), case.v.bfloat16().float()
        torch.testing.assert_close(_run(case).float(), _reference(case), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_backend_reads_an_fp8_pool_with_fixed_scales(name, mode):
    """An FP8 pool with one K and one V scale per layer (`fp8_scales="tensor"`, what FlashInfer
    reads): the new tokens' K/V stored by the backend (`set_kv`: x / scale), bf16 q, against the
    float64 reference over the pool's dequantized rows."""
    heads, kv_heads, head_dim = 16, 2, 64  # the tiny models' head_dim: FlashInfer JITs once
    device = torch.device("cuda")
    storage = KVStorage(POOL_SIZE * 16, num_layers=1, kv_heads=kv_heads, head_dim=head_dim,
                        dtype=torch.float8_e4m3fn, device=device, compute_dtype=torch.bfloat16,
                        fp8_scales="tensor")
    storage.set_tensor_scales(0, 0.02, 0.005)  # rows of ~N(0, 1): codes up to ~250 / ~900
    backend = attention_backend_class(name)(
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        req_to_token_pool=ReqToTokenPool(32, 2304, device), kv_storage=storage)
    rng = random.Random(3)
    for bs in (1, 5, 16):
        case = _case(backend, rng, mode=mode, bs=bs, max_prefix=2000, max_extend=300)
        case.q = case.q.bfloat16()
        got = _run(case).float()
        new_k, new_v = storage.read(0, case.out_cache_loc)
        case.k, case.v = new_k.flatten(1).float(), new_v.flatten(1).float()
        want = _reference(_dequantized_prefixes(case))
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def _dequantized_prefixes(case):
    """`case` with its cached prefixes' rows rewritten as their dequantized values in a 16-bit
    pool of the same slots (`_reference` reads the pool's rows as values)."""
    import copy
    import dataclasses

    storage = case.backend.kv_storage
    plain = KVStorage(storage.size, num_layers=1, kv_heads=storage.kv_heads,
                      head_dim=storage.head_dim, dtype=torch.float32, device=storage.device)
    every = torch.arange(storage.size + 1, device=storage.device)
    plain.k_buffers[0][:], plain.v_buffers[0][:] = storage.read(0, every)
    backend = copy.copy(case.backend)
    backend.kv_storage = plain
    return dataclasses.replace(case, backend=backend)


@pytest.fixture(scope="module")
def head_dim_64_model(tmp_path_factory, smollm2_dir):
    """A tiny random llama whose head_dim (64) every GPU backend serves."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", hidden_size=256, intermediate_size=512,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=1024,
                                  vocab_size=49152, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.08)
    folder = tmp_path_factory.mktemp("hd64")
    model.save_pretrained(folder)
    for file in smollm2_dir.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(file, folder / file.name)
    return folder


@pytest.mark.parametrize("name", BACKENDS)
def test_whole_model_through_the_backend_and_its_graphs(head_dim_64_model, name):
    folder = head_dim_64_model
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(4, 300))] for _ in range(9)]
    params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 16}
    # fp32 where the backend serves it (exact greedy agreement), else bf16 (mostly equal).
    exact = attention_backend_class(name).unsupported(dtype=torch.float32, head_dim=64) is None
    if exact:
        torch.backends.cuda.matmul.allow_tf32 = False
    options = dict(device="cuda", dtype="float32" if exact else "bfloat16",
                   max_total_tokens=16384, context_length=512, max_running_requests=16)
    with Runtime(folder, attention_backend="torch_native", disable_cuda_graph=True,
                 **options) as reference:
        expected = reference.generate(input_ids=prompts, sampling_params=params)
    with Runtime(folder, attention_backend=name, **options) as rt:
        assert rt.stats()["cuda_graph_batch_sizes"][-1] == 16  # graphs on by default
        got = rt.generate(input_ids=prompts, sampling_params=params)
        rt.check_integrity()
    if exact:
        assert [g["output_ids"] for g in got] == [e["output_ids"] for e in expected]
        return
    same = sum(a == b for g, e in zip(got, expected, strict=True)
               for a, b in zip(g["output_ids"], e["output_ids"], strict=True))
    assert same >= 0.8 * sum(len(e["output_ids"]) for e in expected)
