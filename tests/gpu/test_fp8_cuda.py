"""FP8 on the GPU: the `_scaled_mm` path, the compiled skinny GEMM over FP8 weights (with the
norm, rotary and an FP8 pool's K/V store fused in), the W8A8 inputs quantized inside the
RMSNorm and SiLU-and-mul kernels (served tokens against the ablation's), the rotary kernel's
FP8 K/V store with per-(token, head) scales, and a tiny model end to end with FP8 weights and
an FP8 KV cache through the Triton backend (per-token scales) and FlashInfer (one scale per
tensor), with CUDA graphs (against bf16).
(tests/test_fp8.py also runs here: its kernel tests compiled on the GPU.)"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from lmnb.runtime.engine import Runtime
from lmnb.runtime.models.layers import fp8
from tests.gpu.test_gpu_attention_backends import head_dim_64_model  # noqa: F401 (fixture)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available()
                                 or torch.cuda.get_device_capability() < (8, 9),
                                 reason="needs a CUDA device with FP8 (compute capability 8.9+)")]

BACKENDS = ["triton", pytest.param("flashinfer", marks=pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None, reason="flashinfer is not installed"))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [17, 300])
def test_scaled_mm_path_is_the_reference_math(dtype, m):
    gen = torch.Generator(device="cuda").manual_seed(m)
    w, scale = fp8.quantize_rows(torch.randn(384, 512, device="cuda", generator=gen))
    x = torch.randn(m, 512, device="cuda", generator=gen).to(dtype)
    bias = torch.randn(384, device="cuda", generator=gen).to(dtype)
    out = fp8.fp8_linear(x, w, scale, bias, fused=False)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), fp8.scaled_mm_reference(x, w, scale, bias).float(),
                               atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize(("n", "k"), [(28672, 4096), (2 * 1792, 4096), (2 * 37, 1000)])
def test_compiled_gated_fp8_gemv_is_silu_and_mul_of_it(dtype, m, n, k):
    """gate_up with SiLU-and-mul in the epilogue (Llama-3-8B's, a tensor-parallel shard's,
    a ragged one) against the GEMM and `silu_and_mul` apart, rounded at the same places (equal
    but for an MMA's order of a sum); with split K through the gated reduce."""
    from lmnb.runtime.kernels.fused import silu_and_mul
    from lmnb.runtime.kernels.fused.gemv_fp8 import Fp8GemvConfig, fp8_gemv

    gen = torch.Generator(device="cuda").manual_seed(n + m + 1)
    w, scale = fp8.quantize_rows(torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5)
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    bias = torch.randn(n, device="cuda", generator=gen).to(dtype) if m % 2 else None
    split = Fp8GemvConfig(2, 512, 2, 2, 1, False) if m == 1 else Fp8GemvConfig(
        32, 256, 2, 4, 4, True)
    for config in (None, split):
        got = fp8_gemv(x, w, scale, bias, config, gated=True)
        want = silu_and_mul(fp8_gemv(x, w, scale, bias, config))
        assert got.shape == (m, n // 2)
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16])  # FP8 pools: the test below
def test_compiled_rotary_epilogue_at_llama_3_8b_qkv(m, kv_dtype):
    """Llama-3-8B's decode qkv as one kernel (norm, GEMM, neox rotary, k and v to the pool's
    slots) against the norm-fused GEMM, then `rotary_qkv` storing to a second pool: equal."""
    from lmnb.runtime.kernels.fused import rotary_qkv
    from lmnb.runtime.kernels.fused.gemv_fp8 import RmsNormInput, RotaryStore, fp8_norm_gemv

    heads, kv_heads, head_dim, k = 32, 8, 128, 4096
    gen = torch.Generator(device="cuda").manual_seed(m + 3)
    n = (heads + 2 * kv_heads) * head_dim
    w, scale = fp8.quantize_rows(torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    norm = RmsNormInput(torch.randn(m, k, device="cuda", generator=gen).bfloat16(),
                        (torch.rand(k, device="cuda", generator=gen) + 0.5).bfloat16(), 1e-5)
    freqs = torch.outer(torch.arange(8192.0, device="cuda"),
                        5e5 ** -(torch.arange(0, head_dim, 2, device="cuda") / head_dim))
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    positions = torch.randint(0, 8192, (m,), device="cuda", generator=gen)
    slots = torch.randperm(64, device="cuda", generator=gen)[:m]
    pools = [tuple(torch.zeros(64, kv_heads, head_dim, device="cuda").to(kv_dtype)
                   for _ in range(2)) for _ in range(2)]
    qkv, stream = fp8_norm_gemv(x, norm, w, scale)
    want, _ = rotary_qkv(positions, qkv, cos, sin, num_heads=heads, num_kv_heads=kv_heads,
                         head_dim=head_dim, kv_buffers=pools[0], slots=slots)
    got, got_stream = fp8_norm_gemv(x, norm, w, scale, rope=RotaryStore(
        positions, cos, sin, heads, kv_heads, head_dim, *pools[1], slots))
    assert torch.equal(got_stream, stream)
    # the same sums (one row: the same FMA code; more: the MMA's, rows permuted), then the same
    # rounding: equal; FP8 pool entries within an e4m3 step should an MMA order differ
    exact = {"rtol": 0, "atol": 0}
    torch.testing.assert_close(got, want, **(exact if m == 1 else {"rtol": 2**-7, "atol": 2**-6}))
    tol = exact if m == 1 else {"rtol": 2**-3 if kv_dtype == fp8.FP8 else 2**-7, "atol": 2**-6}
    for a, b in zip(pools[0], pools[1], strict=True):
        torch.testing.assert_close(a.float(), b.float(), **tol)


def test_arrival_counters_are_not_allocated_inside_a_graph_capture():
    """Inside a capture the counters come from the buffer an eager run allocated; more than it
    holds is an error (an allocation there would be zeroed only when the graph replays)."""
    from lmnb.runtime.kernels.arrivals import arrival_counters

    device = torch.device("cuda", torch.cuda.current_device())
    eager = arrival_counters(device, 8)
    work = torch.zeros(1, device=device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        inside = arrival_counters(device, 8)
        with pytest.raises(RuntimeError, match="inside a CUDA-graph capture"):
            arrival_counters(device, 1 << 24)
        work.add_(1)  # a graph with a node
    assert inside.data_ptr() == eager.data_ptr()


@pytest.mark.parametrize("m", [1, 3, 16])
def test_compiled_rotary_epilogue_stores_an_fp8_pool_as_rotary_qkv_does(m):
    """Llama-3-8B's decode qkv over an FP8 pool as one kernel (norm, GEMM, rotary, each (token,
    KV head) row's e4m3 bytes and scale, a head's 64 pairs spread over programs that meet at an
    arrival counter) against the norm-fused GEMM, then `rotary_qkv` storing to a second pool:
    one row bit for bit (bytes and scales); more rows within an e4m3 step (the MMA's order of
    a sum). Five rounds of fresh inputs into the same slots: a program reading another round's
    staged rows, or a counter left non-zero, would show."""
    from lmnb.runtime.kernels.arrivals import arrival_counters
    from lmnb.runtime.kernels.fused import rotary_qkv
    from lmnb.runtime.kernels.fused.gemv_fp8 import RmsNormInput, RotaryStore, fp8_norm_gemv

    heads, kv_heads, head_dim, k = 32, 8, 128, 4096
    gen = torch.Generator(device="cuda").manual_seed(m + 5)
    n = (heads + 2 * kv_heads) * head_dim
    w, scale = fp8.quantize_rows(torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5)
    freqs = torch.outer(torch.arange(8192.0, device="cuda"),
                        5e5 ** -(torch.arange(0, head_dim, 2, device="cuda") / head_dim))
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    slots = torch.randperm(64, device="cuda", generator=gen)[:m]
    pools = [(tuple(torch.zeros(64, kv_heads, head_dim, device="cuda").to(fp8.FP8)
                    for _ in range(2)),
              tuple(torch.ones(64, kv_heads, device="cuda") for _ in range(2))) for _ in range(2)]
    for _ in range(5):
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        x[:, torch.randint(0, k, (4,), device="cuda", generator=gen)] *= 30  # outlier channels
        norm = RmsNormInput(torch.randn(m, k, device="cuda", generator=gen).bfloat16(),
                            (torch.rand(k, device="cuda", generator=gen) + 0.5).bfloat16(), 1e-5)
        positions = torch.randint(0, 8192, (m,), device="cuda", generator=gen)
        qkv, _ = fp8_norm_gemv(x, norm, w, scale)
        want, _ = rotary_qkv(positions, qkv, cos, sin, num_heads=heads, num_kv_heads=kv_heads,
                             head_dim=head_dim, kv_buffers=pools[0][0], slots=slots,
                             kv_scales=pools[0][1])
        got, _ = fp8_norm_gemv(x, norm, w, scale, rope=RotaryStore(
            positions, cos, sin, heads, kv_heads, head_dim, *pools[1][0], slots, pools[1][1]))
        if m == 1:  # the same FMA sums, rotation and rounding
            assert torch.equal(got, want)
            for a, b in zip((*pools[0][0], *pools[0][1]), (*pools[1][0], *pools[1][1]),
                            strict=True):
                assert torch.equal(a.view(torch.uint8) if a.dtype == fp8.FP8 else a,
                                   b.view(torch.uint8) if b.dtype == fp8.FP8 else b)
        else:
            torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-6)
            for (a, sa), (b, sb) in zip(zip(*pools[0], strict=True), zip(*pools[1], strict=True),
                                        strict=True):
                torch.testing.assert_close(sa, sb, rtol=2**-7, atol=0)
                torch.testing.assert_close(a[slots].float() * sa[slots, :, None],
                                           b[slots].float() * sb[slots, :, None],
                                           rtol=2**-3, atol=2**-6)
    torch.cuda.synchronize()
    assert not arrival_counters(w.device, 2 * kv_heads).any()


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize(("n", "k", "gated"), [(6144, 4096, False), (28672, 4096, True),
                                               (2 * 37, 1000, True), (40, 1002, False)])
def test_compiled_fp8_norm_gemv_is_rms_norm_then_the_gemm(m, n, k, gated):
    """RMSNorm + residual add in the prologue (qkv, gate_up with SiLU: Llama-3-8B's decode
    fusions; ragged shapes, K not a multiple of 4: x element by element) against `rms_norm`,
    then the GEMM (and `silu_and_mul`) apart, bf16: the residual stream equal, the output
    within the separate norm's roundings; the first layer's form (no residual) too."""
    from lmnb.runtime.kernels.fused import rms_norm, silu_and_mul
    from lmnb.runtime.kernels.fused.gemv_fp8 import RmsNormInput, fp8_gemv, fp8_norm_gemv

    gen = torch.Generator(device="cuda").manual_seed(n + m + 2)
    w, scale = fp8.quantize_rows(torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    residual = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    g = (torch.rand(k, device="cuda", generator=gen) + 0.5).bfloat16()
    for res in (residual, None):
        normed, stream = (rms_norm(x, g, 1e-5), x) if res is None else rms_norm(x, g, 1e-5, res)
        want = fp8_gemv(normed, w, scale)
        want = silu_and_mul(want) if gated else want
        got, got_stream = fp8_norm_gemv(x, RmsNormInput(res, g, 1e-5), w, scale, gated=gated)
        assert torch.equal(got_stream, stream)
        # compiled: s * g rounded to bf16 once (bf16x2), where the separate norm rounds
        # s * rstd and then * g; a few bf16 ulps of the largest output apart at most
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-6,
                                   atol=2**-6 * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 7, 16])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
                                      (1024, 4096), (40, 96), (1000, 1000)])
def test_compiled_fp8_gemv_at_llama_3_8b_shapes(dtype, m, n, k):
    """The FP8 skinny GEMM with its table's / rule's config (Llama-3-8B's qkv, o, gate_up and
    down, a tensor-parallel shard, ragged shapes) against float32 math over the dequantized
    weight."""
    from lmnb.runtime.kernels.fused.gemv_fp8 import fp8_gemv

    gen = torch.Generator(device="cuda").manual_seed(n + m)
    w, scale = fp8.quantize_rows(torch.randn(n, k, device="cuda", generator=gen)
                                 * torch.logspace(-3, 0, n, device="cuda")[:, None])
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    bias = torch.randn(n, device="cuda", generator=gen).to(dtype) if m % 2 else None
    out = fp8_gemv(x, w, scale, bias)
    want = x.float() @ fp8.dequantize_rows(w, scale).t()
    magnitude = x.float().abs() @ fp8.dequantize_rows(w, scale).abs().t()
    if bias is not None:
        want += bias.float()
        magnitude += bias.float().abs()
    error = (out.float() - want).abs()
    assert out.dtype == dtype and (error <= 1e-4 * magnitude + 2**-7 * want.abs()).all()


def test_rotary_kernel_stores_fp8_kv_with_per_head_scales():
    """Compiled: each (token, KV head) row of K and V is stored divided by amax / 448 with that
    scale beside it, so rows of any size (here 1000x) come back within e4m3's step, no NaN."""
    from lmnb.runtime.kernels.fused.rope import rotary_qkv
    from lmnb.runtime.memory import KVStorage

    heads, kv_heads, dim = 4, 2, 64
    qkv = torch.randn(3, (heads + 2 * kv_heads) * dim, device="cuda").to(torch.bfloat16)
    qkv[1] *= 1000
    cos = torch.ones(8, dim // 2, device="cuda")
    sin = torch.zeros(8, dim // 2, device="cuda")
    storage = KVStorage(5, num_layers=1, kv_heads=kv_heads, head_dim=dim, dtype=fp8.FP8,
                        device=torch.device("cuda"), compute_dtype=torch.float32)
    slots = torch.tensor([1, 3, 5], device="cuda")
    rotary_qkv(torch.zeros(3, dtype=torch.int64, device="cuda"), qkv, cos, sin,
               num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
               kv_buffers=(storage.k_buffers[0], storage.v_buffers[0]), slots=slots,
               kv_scales=storage.scales(0))
    k_back, v_back = storage.read(0, slots)
    for got, start in ((k_back, heads), (v_back, heads + kv_heads)):
        want = qkv[:, start * dim:(start + kv_heads) * dim].float().view(3, kv_heads, dim)
        amax = want.abs().amax(-1, keepdim=True)
        assert not got.isnan().any()
        assert ((got - want).abs() <= want.abs() * 2**-4 * 1.01 + amax / 448 * 2**-9).all()


def _first_tokens_in_top5(got: list[dict], expected: list[dict]) -> int:
    """How many requests' first expected token is among the five likeliest of `got`'s first
    step (`top_logprobs_num=5`)."""
    return sum(e["output_ids"][0] in [t[1] for t in g["meta_info"]["output_top_logprobs"][0]]
               for g, e in zip(got, expected, strict=True))


def _agreeing_steps(got: dict, expected: dict) -> tuple[int, bool]:
    """Steps of one request whose tokens agree before the first that does not (the decode
    steps after the prefill's token), and whether at that step the expected token is among
    the five likeliest of `got`'s (`top_logprobs_num=5`; True where all agree)."""
    top = got["meta_info"]["output_top_logprobs"]
    for step, (mine, theirs) in enumerate(zip(got["output_ids"], expected["output_ids"],
                                              strict=True)):
        if mine != theirs:
            return step, theirs in [t[1] for t in top[step]]
    return len(got["output_ids"]), True


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_model_fp8_weights_and_kv_end_to_end(request, backend):
    folder = request.getfixturevalue("head_dim_64_model")
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(1, 300))] for _ in range(20)]
    greedy = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 16}
    options = dict(device="cuda", dtype="bfloat16", context_length=512,
                   attention_backend=backend, max_running_requests=32)
    with Runtime(folder, **options) as reference:
        bf16_tokens = reference.max_total_tokens
        expected = reference.generate(input_ids=prompts, sampling_params=greedy)
    for extra in ({"quantization": "fp8"}, {"kv_cache_dtype": "fp8_e4m3"},
                  {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"}):
        with Runtime(folder, **options, **extra) as rt:
            got = rt.generate(input_ids=prompts, sampling_params=greedy, return_logprob=True,
                              top_logprobs_num=5)
            rt.check_integrity()
            if "kv_cache_dtype" in extra:  # about twice the tokens in the same memory:
                # 64 FP8 bytes + a float32 scale per row against 128 bytes is 1.88x (FlashInfer's
                # pool, one scale per tensor: 2x), less the allocator's per-slot bookkeeping,
                # which weighs on a model of few layers
                assert rt.stats()["kv_fp8_scales"] == ("tensor" if backend == "flashinfer"
                                                      else "token")
                assert rt.max_total_tokens > 1.75 * bf16_tokens
        # a random tiny model has many near-ties, so the argmax flips often (on the H100 13 of
        # 20 first tokens agree for fp8 weights, 9 of 20 with the FP8 KV cache too); bf16's
        # choice stays among the five likeliest, where broken scales or a misread KV cache
        # would put it among 49,152 at random
        in_top5 = _first_tokens_in_top5(got, expected)
        assert in_top5 >= 0.9 * len(prompts), (extra, in_top5)


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None,
                    reason="flashinfer is not installed")
def test_checkpoint_kv_scales_through_flashinfer(request, tmp_path):
    """An FP8 checkpoint with calibrated KV scales (compressed-tensors `kv_cache_scheme`) served
    through FlashInfer with the FP8 KV cache: the pool takes the checkpoint's scales, and bf16's
    first token stays among the five likeliest (as above)."""
    from tests.test_fp8 import _with_kv_scales, _write_compressed_tensors

    folder = request.getfixturevalue("head_dim_64_model")
    checkpoint = _with_kv_scales(
        _write_compressed_tensors(folder, tmp_path / "fp8", strategy="channel"), tmp_path / "kv")
    rng = random.Random(8)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(1, 300))] for _ in range(20)]
    greedy = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 16}
    options = dict(device="cuda", dtype="bfloat16", context_length=512,
                   attention_backend="flashinfer", max_running_requests=32)
    with Runtime(folder, **options) as reference:
        expected = reference.generate(input_ids=prompts, sampling_params=greedy)
    with Runtime(checkpoint, kv_cache_dtype="fp8_e4m3", **options) as rt:
        assert rt.stats()["kv_fp8_scales"] == "tensor"
        got = rt.generate(input_ids=prompts, sampling_params=greedy, return_logprob=True,
                          top_logprobs_num=5)
        rt.check_integrity()
    in_top5 = _first_tokens_in_top5(got, expected)
    assert in_top5 >= 0.9 * len(prompts), in_top5


def test_gptq_weight_only_checkpoint_end_to_end(request, tmp_path):
    """bench/fp8_gptq.py's weight-only FP8 checkpoint (first layer 16-bit) served on the GPU:
    prefill runs the W8A16 GEMM (no `_scaled_mm`), decode at one row the skinny GEMV and past
    it the W8A16 GEMM (at 2-16 rows on split-K tiles: 4 requests decode together); the same
    top-5 check as above against the 16-bit model, and the 4 requests' tokens walked through
    their decode steps."""
    from bench.fp8_gptq import write_fp8_checkpoint

    folder = request.getfixturevalue("head_dim_64_model")
    rng = random.Random(6)
    calib = torch.tensor([rng.randrange(3, 49152) for _ in range(256)])
    checkpoint = write_fp8_checkpoint(folder, tmp_path / "gptq", calib=calib, skip_layers=(0,))
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(20, 300))] for _ in range(20)]
    greedy = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 16}
    options = dict(device="cuda", dtype="bfloat16", context_length=512, max_running_requests=32)
    with Runtime(folder, **options) as reference:
        expected = reference.generate(input_ids=prompts, sampling_params=greedy)
    with Runtime(checkpoint, **options) as rt:
        got = rt.generate(input_ids=prompts, sampling_params=greedy, return_logprob=True,
                          top_logprobs_num=5)
        few = rt.generate(input_ids=prompts[:4], sampling_params=greedy, return_logprob=True,
                          top_logprobs_num=5)
        rt.check_integrity()
    in_top5 = _first_tokens_in_top5(got, expected)
    assert in_top5 >= 0.9 * len(prompts), in_top5
    walks = [_agreeing_steps(g, e) for g, e in zip(few, expected[:4], strict=True)]
    assert sum(near for _, near in walks) >= 3, walks
    assert sum(steps for steps, _ in walks) > 4, walks  # decode steps compared


@pytest.mark.parametrize("m", [17, 100, 512])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336)])  # Llama-3-8B qkv, down
def test_compiled_w8a16_mm_at_llama_3_8b_shapes(m, n, k):
    """The weight-only FP8 GEMM with its rule's config against float32 sums over the exact
    dequantized weight: within bf16's output rounding."""
    from lmnb.runtime.kernels.fused.mm_fp8 import w8a16_mm

    gen = torch.Generator(device="cuda").manual_seed(m)
    w, scale = fp8.quantize_rows(torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    want = x.float() @ fp8.dequantize_rows(w, scale).t()
    got = w8a16_mm(x, w, scale)
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=2**-7 * want.abs().max())


def _fp8_serving(*, seed: int, requests: int, max_running_requests: int
                 ) -> tuple[list[list[int]], dict, dict]:
    """Random prompts of 20-300 ids, 8 greedy tokens each, and the FP8 Runtime's options
    (bf16 activations, Triton attention)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(20, 300))]
               for _ in range(requests)]
    greedy = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 8}
    options = dict(device="cuda", dtype="bfloat16", context_length=512, quantization="fp8",
                   attention_backend="triton", max_running_requests=max_running_requests)
    return prompts, greedy, options


def test_quantizing_norm_and_activation_keep_the_served_tokens(request, monkeypatch):
    """FP8 weights served with the W8A8 GEMMs' inputs quantized inside the RMSNorm and
    SiLU-and-mul kernels (prefill, and decode at 20 rows: past the skinny path, in CUDA graphs)
    against the ablation quantizing them apart (`linear.FP8_QUANT_FUSIONS` off): the fused
    kernels ran, and the tokens and their logprobs are the same, bit for bit."""
    from lmnb.runtime.kernels.fused import rmsnorm
    from lmnb.runtime.models.layers import linear

    folder = request.getfixturevalue("head_dim_64_model")
    prompts, greedy, options = _fp8_serving(seed=7, requests=20, max_running_requests=32)
    calls: list[int] = []
    op = rmsnorm.rms_norm_quant
    monkeypatch.setattr(rmsnorm, "rms_norm_quant",
                        lambda *a, **k: (calls.append(1), op(*a, **k))[1])
    outputs = []
    for fusions in (True, False):
        monkeypatch.setattr(linear, "FP8_QUANT_FUSIONS", fusions)
        with Runtime(folder, **options) as rt:
            outputs.append(rt.generate(input_ids=prompts, sampling_params=greedy,
                                       return_logprob=True))
        assert bool(calls) == fusions
        calls.clear()
    fused, apart = outputs
    for f, a in zip(fused, apart, strict=True):
        assert f["output_ids"] == a["output_ids"]
        assert f["meta_info"]["output_token_logprobs"] == a["meta_info"]["output_token_logprobs"]


@pytest.mark.parametrize("swap_ab", [True, False])
def test_decode_batches_of_2_to_16_take_the_decode_rows_w8a8_gemm(request, monkeypatch, swap_ab):
    """Four requests decoding (CUDA graphs, captured at 1-8 rows and more): the FP8 linears
    of 2-16 rows run the Triton W8A8 GEMM over per-token FP8 rows, not the skinny W8A16 kernel,
    on `mm_fp8.decode_rows_config`'s tiles: swapped (the default; K = 512 too short to split)
    or not (`W8A8_DECODE_SWAP_AB` off: down_proj's K split); the tokens agree with the
    skinny kernel's (`fp8.W8A16_MAX_ROWS` = 16) as FP8 runs agree with bf16: each request's
    tokens the same up to a step where the expected one is among the five likeliest, through
    the decode steps (not only the prefill's token)."""
    from lmnb.runtime.kernels.fused import gemv_fp8, mm_fp8
    from lmnb.runtime.kernels.multiprocessors import multiprocessors

    folder = request.getfixturevalue("head_dim_64_model")
    prompts, greedy, options = _fp8_serving(seed=11, requests=4, max_running_requests=8)
    monkeypatch.setattr(mm_fp8, "W8A8_DECODE_SWAP_AB", swap_ab)
    configs: list[tuple[int, mm_fp8.W8A16Config]] = []
    op = mm_fp8.w8a8_mm

    def counting(codes, *args, **kwargs):
        m, k = codes.shape
        sms = multiprocessors(codes.device) or 1
        configs.append((m, mm_fp8.w8a8_config(m, args[1].shape[0], k, sms)))
        return op(codes, *args, **kwargs)

    monkeypatch.setattr(mm_fp8, "w8a8_mm", counting)
    skinny_rows: list[int] = []
    gemv = gemv_fp8.fp8_gemv
    monkeypatch.setattr(gemv_fp8, "fp8_gemv",
                        lambda x, *a, **k: (skinny_rows.append(x.shape[0]), gemv(x, *a, **k))[1])
    with Runtime(folder, **options) as rt:
        got = rt.generate(input_ids=prompts, sampling_params=greedy, return_logprob=True,
                          top_logprobs_num=5)
        rt.check_integrity()
    at_4 = [cfg for m, cfg in configs if m == 4]
    assert at_4 and all(cfg.swap_ab == swap_ab for cfg in at_4)
    assert swap_ab or any(cfg.split_k > 1 for cfg in at_4)
    assert 1 in skinny_rows and not [m for m in skinny_rows if m > 1]
    monkeypatch.setattr(fp8, "W8A16_MAX_ROWS", fp8.SKINNY_MAX_ROWS)
    with Runtime(folder, **options) as rt:
        expected = rt.generate(input_ids=prompts, sampling_params=greedy)
    walks = [_agreeing_steps(g, e) for g, e in zip(got, expected, strict=True)]
    assert sum(near for _, near in walks) >= 3, walks
    assert sum(steps for steps, _ in walks) > len(prompts), walks  # decode steps compared
