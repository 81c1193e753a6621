"""Triton attention kernels and backend against float64 / torch-native references.

Without CUDA (or with TRITON_INTERPRET=1 already set) the kernels run in Triton's CPU interpreter
on CPU tensors, with small shapes; with CUDA they are compiled and run on the GPU, with lengths up
to 2k. tests/triton_modes.py picks the mode.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

# tests.triton_modes sets TRITON_INTERPRET: it is imported before any kernel module.
from tests.sm90 import assert_compiles_for_sm90
from tests.triton_modes import DEVICES, INTERPRET, SAME_TRITON_MODE

# isort: split
from lmnb.runtime.core import ForwardMode
from lmnb.runtime.forward_batch import ForwardBatch
from lmnb.runtime.kernels.registry import (
    attention_backend_class,
    select_attention_backend,
)
from lmnb.runtime.kernels.triton_backend import TritonAttention
from lmnb.runtime.kernels.triton_decode import decode_attention, partial_buffers
from lmnb.runtime.kernels.triton_extend import extend_attention
from lmnb.runtime.memory import KVAllocator, KVStorage, ReqToTokenPool

pytestmark = SAME_TRITON_MODE

SHAPES = [(4, 4, 64), (8, 2, 128), (8, 1, 64)]  # (heads, kv_heads, head_dim): GQA 1, 4, 8
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _max_len(device: str) -> int:
    return 300 if device == "cpu" else 2048


def _pool(num_slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
          device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K/V pool [num_slots + 1, kv_heads, head_dim]; row 0 is the zero padding slot."""
    shape = (num_slots + 1, kv_heads, head_dim)
    k, v = (torch.randn(shape, device=device).to(dtype) for _ in range(2))
    k[0], v[0] = 0, 0
    return k, v


def _reference(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
               slots: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """float64 attention of q [n, heads, dim] (positions prefix_len...) over slots, causal."""
    n, heads, dim = q.shape
    group = heads // k_buffer.shape[1]
    keys = k_buffer[slots].double().repeat_interleave(group, dim=1)  # [seq, heads, dim]
    values = v_buffer[slots].double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * dim**-0.5
    rows = torch.arange(prefix_len, prefix_len + n, device=q.device)[:, None]
    allowed = torch.arange(len(slots), device=q.device)[None, :] <= rows
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, values)


def _ragged(seq_lens: list[int], device: str,
            gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_indptr and scattered kv_indices (slots 1..) for requests of these lengths."""
    total = sum(seq_lens)
    kv_indices = (torch.randperm(total, generator=gen) + 1).to(device)
    kv_indptr = torch.tensor([0, *seq_lens], device=device).cumsum(0)
    return kv_indptr, kv_indices


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decode_kernel_matches_float64(device, heads, kv_heads, head_dim, dtype):
    rng, gen = random.Random(heads + head_dim), torch.Generator().manual_seed(heads)
    top = _max_len(device)
    seq_lens = [1, 2, rng.randint(60, 70), rng.randint(1, top), top]
    kv_indptr, kv_indices = _ragged(seq_lens, device, gen)
    k_buffer, v_buffer = _pool(sum(seq_lens), kv_heads, head_dim, dtype, device)
    q = torch.randn(len(seq_lens), heads, head_dim, device=device).to(dtype)
    for splits in (1, 5):
        out = torch.empty_like(q)
        partials = partial_buffers(len(seq_lens), heads, head_dim, splits, q.device)
        decode_attention(q, k_buffer, v_buffer, out, kv_indptr, kv_indices, *partials,
                         scale=head_dim**-0.5, max_kv_splits=splits)
        for i, n in enumerate(seq_lens):
            slots = kv_indices[kv_indptr[i]:kv_indptr[i] + n]
            expected = _reference(q[i:i + 1], k_buffer, v_buffer, slots, n - 1)
            tol = TOLERANCE[dtype]
            torch.testing.assert_close(out[i:i + 1].double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_extend_kernel_matches_float64(device, heads, kv_heads, head_dim, dtype):
    rng, gen = random.Random(heads * head_dim), torch.Generator().manual_seed(head_dim)
    top = _max_len(device)
    small = device == "cpu"
    prefix_lens = [0, rng.randint(1, top // 2), 0 if small else top, rng.randint(1, 9)]
    extend_lens = [rng.randint(1, top // 3), rng.randint(1, 70), 1, top - 9 if not small else 5]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    kv_indptr, kv_indices = _ragged(seq_lens, device, gen)
    qo_indptr = torch.tensor([0, *extend_lens], device=device).cumsum(0)
    k_buffer, v_buffer = _pool(sum(seq_lens), kv_heads, head_dim, dtype, device)
    q = torch.randn(sum(extend_lens), heads, head_dim, device=device).to(dtype)
    out = extend_attention(q, k_buffer, v_buffer, torch.empty_like(q), qo_indptr, kv_indptr,
                           kv_indices, max_extend_len=max(extend_lens), scale=head_dim**-0.5)
    for i, prefix in enumerate(prefix_lens):
        slots = kv_indices[kv_indptr[i]:kv_indptr[i + 1]]
        rows = slice(qo_indptr[i], qo_indptr[i + 1])
        expected = _reference(q[rows], k_buffer, v_buffer, slots, prefix)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(out[rows].double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_extend_kernel_configs_match_float64(device):
    """The tile rule's two block heights, and K loaded token-major: a prefix, a block boundary
    inside the new tokens (the unmasked part then the diagonal), one new token."""
    from lmnb.runtime.kernels.triton_extend import ExtendConfig, extend_config

    assert extend_config(128, torch.bfloat16, rows=[128], group=4).block_m == 128
    assert extend_config(128, torch.bfloat16, rows=[4000], group=4).block_m == 128
    assert extend_config(128, torch.bfloat16, rows=[160], group=4).block_m == 64
    assert extend_config(128, torch.bfloat16, rows=[4000], group=1).block_m == 64
    # the batch's rows, not its longest request's: a long chunk beside many short extends
    assert extend_config(128, torch.bfloat16, rows=[4192, *[160] * 155], group=4).block_m == 64
    assert extend_config(128, torch.bfloat16, rows=[6160] * 5 + [160], group=4).block_m == 128
    gen = torch.Generator().manual_seed(11)
    prefix_lens, extend_lens = [37, 0, 5], [21, 9, 1]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    kv_indptr, kv_indices = _ragged(seq_lens, device, gen)
    qo_indptr = torch.tensor([0, *extend_lens], device=device).cumsum(0)
    k_buffer, v_buffer = _pool(sum(seq_lens), 2, 32, torch.float32, device)
    q = torch.randn(sum(extend_lens), 8, 32, device=device)
    for config in (ExtendConfig(16, 16, 4, 1), ExtendConfig(32, 16, 4, 1, k_rows=True)):
        out = extend_attention(q, k_buffer, v_buffer, torch.empty_like(q), qo_indptr, kv_indptr,
                               kv_indices, max_extend_len=max(extend_lens), scale=32**-0.5,
                               config=config)
        for i, prefix in enumerate(prefix_lens):
            slots = kv_indices[kv_indptr[i]:kv_indptr[i + 1]]
            rows = slice(qo_indptr[i], qo_indptr[i + 1])
            expected = _reference(q[rows], k_buffer, v_buffer, slots, prefix)
            torch.testing.assert_close(out[rows].double(), expected, atol=1e-4, rtol=1e-4)


def _backends(device: str, heads: int = 8, kv_heads: int = 2, head_dim: int = 64):
    """A Triton and a torch-native backend over one shared request table and KV pool."""
    pool = ReqToTokenPool(16, 512, torch.device(device))
    storage = KVStorage(4096, num_layers=1, kv_heads=kv_heads, head_dim=head_dim,
                        dtype=torch.float32, device=torch.device(device))
    kwargs = dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                  req_to_token_pool=pool, kv_storage=storage)
    return (TritonAttention(**kwargs, max_kv_splits=4),
            attention_backend_class("torch_native")(**kwargs))


def _batch(backend, rng: random.Random, allocator: KVAllocator, mode: ForwardMode,
           bs: int) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A ragged batch with random cached prefixes in the pool, and its new q/k/v."""
    device = backend.req_to_token_pool.req_to_token.device
    prefix_lens = [rng.choice([0, rng.randint(1, 150)]) for _ in range(bs)]
    if mode is ForwardMode.DECODE:
        prefix_lens, extend_lens = [p + 1 for p in prefix_lens], [1] * bs
    else:
        extend_lens = [rng.randint(1, 40) for _ in range(bs)]
    indices = [backend.req_to_token_pool.alloc() for _ in range(bs)]
    new_loc = []
    for idx, prefix, extend in zip(indices, prefix_lens, extend_lens, strict=True):
        slots = allocator.alloc(prefix + extend)
        backend.req_to_token_pool.req_to_token[idx, :prefix + extend] = slots
        shape = (prefix, backend.num_kv_heads, backend.head_dim)
        backend.kv_storage.k_buffers[0][slots[:prefix]] = torch.randn(shape, device=device)
        backend.kv_storage.v_buffers[0][slots[:prefix]] = torch.randn(shape, device=device)
        new_loc.append(slots[prefix:])
    tokens = sum(extend_lens)
    fb = ForwardBatch.build(mode=mode, input_ids=[0] * tokens, req_pool_indices=indices,
                            prefix_lens=prefix_lens, extend_lens=extend_lens,
                            out_cache_loc=torch.cat(new_loc),
                            req_to_token=backend.req_to_token_pool.req_to_token)
    q, k, v = (torch.randn(tokens, n * backend.head_dim, device=device)
               for n in (backend.num_heads, backend.num_kv_heads, backend.num_kv_heads))
    return fb, q, k, v


def _run(backend, fb: ForwardBatch, q, k, v) -> torch.Tensor:
    backend.init_forward_metadata(fb)
    return backend.forward(q, k, v, 0, fb)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_backend_matches_torch_native(device, mode):
    triton_backend, native = _backends(device)
    allocator = KVAllocator(4096, torch.device(device))
    rng = random.Random(int(mode is ForwardMode.DECODE))
    for bs in (1, 5):
        fb, q, k, v = _batch(triton_backend, rng, allocator, mode, bs)
        got = _run(triton_backend, fb, q, k, v)
        torch.testing.assert_close(got, _run(native, fb, q, k, v), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(triton_backend.kv_storage.v_buffers[0][fb.out_cache_loc],
                                   v.view(len(v), 2, 64), atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_capture_hooks_replay_equals_eager_decode(device):
    backend, _ = _backends(device)
    allocator = KVAllocator(4096, torch.device(device))
    rng = random.Random(9)
    batches = [_batch(backend, rng, allocator, ForwardMode.DECODE, bs) for bs in (3, 1)]
    eager = [_run(backend, *batch) for batch in batches]
    backend.init_capture(max_bs=6, kv_capacity=600)
    assert backend.can_replay(batches[0][0]) and not backend.can_replay(
        dataclasses.replace(batches[0][0], batch_size=7))
    assert not backend.can_replay(dataclasses.replace(batches[0][0], num_kv_tokens=601))
    backend.prepare_for_capture(4)
    pointers = backend._kv_indptr.data_ptr(), backend._partial_out.data_ptr()
    for (fb, q, k, v), expected in zip([*batches, batches[0]], [*eager, eager[0]], strict=True):
        backend.prepare_for_replay(fb, 4)
        assert (backend._kv_indptr.data_ptr(), backend._partial_out.data_ptr()) == pointers
        extra = 4 - fb.batch_size
        q, k, v = (torch.cat((t, torch.randn(extra, t.shape[1], device=device))) for t in (q, k, v))
        padded_loc = torch.cat((fb.out_cache_loc, fb.out_cache_loc.new_zeros(extra)))
        got = backend.forward(q, k, v, 0, dataclasses.replace(fb, out_cache_loc=padded_loc))
        torch.testing.assert_close(got[:len(expected)], expected, atol=1e-5, rtol=1e-5)
        assert torch.isfinite(got).all()
        _run(backend, *batches[1])  # an eager step in between must not leak into the next replay


def test_registered_as_triton_and_cpu_auto_stays_torch_native():
    assert attention_backend_class("triton") is TritonAttention
    assert TritonAttention.supports_capture
    assert select_attention_backend("auto", torch.device("cpu")).name == "torch_native"
    assert TritonAttention.unsupported(dtype=torch.bfloat16, head_dim=80) is None
    assert "float8" in TritonAttention.unsupported(dtype=torch.float8_e5m2, head_dim=128)
    on_cuda = select_attention_backend("auto", torch.device("cuda"), dtype=torch.float32,
                                       head_dim=64)  # FlashInfer takes no fp32 KV
    assert on_cuda.name == "triton"


@pytest.mark.parametrize("device", DEVICES)
def test_tiny_model_logits_equal_torch_native(device, tiny_models):
    """Prefill then one decode step of a tiny GQA model: Triton logits == torch-native logits."""
    from lmnb.runtime.config import EngineConfig
    from lmnb.runtime.model_runner import ModelRunner
    from lmnb.runtime.models import loader

    folder = tiny_models["llama-gqa"]
    config = loader.load_model_config(folder)
    model = loader.load_model(folder, config, dtype=torch.float32, device=torch.device(device))
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(3, 40))] for _ in range(3)]
    lens = [len(p) for p in prompts]
    logits = {}
    for name in ("triton", "torch_native"):
        runner = ModelRunner(model, config, EngineConfig(max_total_tokens=512,
                                                         max_running_requests=4,
                                                         attention_backend=name),
                             device=torch.device(device), dtype=torch.float32,
                             eos_token_ids={2})
        assert runner.attn_backend.choice.name == name
        table = runner.req_to_token_pool
        indices = [table.alloc() for _ in prompts]
        slots = KVAllocator(512, torch.device(device)).alloc(sum(lens) + len(lens))
        starts = [sum(lens[:i]) + i for i in range(len(lens))]
        for idx, start, n in zip(indices, starts, lens, strict=True):
            table.req_to_token[idx, :n + 1] = slots[start:start + n + 1]
        prefill = ForwardBatch.build(
            mode=ForwardMode.EXTEND, input_ids=sum(prompts, []), req_pool_indices=indices,
            prefix_lens=[0] * 3, extend_lens=lens, req_to_token=table.req_to_token,
            out_cache_loc=torch.cat([slots[s:s + n] for s, n in zip(starts, lens, strict=True)]))
        decode = ForwardBatch.build(
            mode=ForwardMode.DECODE, input_ids=[5, 6, 7], req_pool_indices=indices,
            prefix_lens=lens, extend_lens=[1] * 3, req_to_token=table.req_to_token,
            out_cache_loc=torch.stack([slots[s + n] for s, n in zip(starts, lens, strict=True)]))
        steps = []
        with torch.inference_mode():
            for fb in (prefill, decode):
                runner.attn_backend.init_forward_metadata(fb)
                steps.append(model.compute_logits(model(fb.input_ids, fb.positions, fb)))
        logits[name] = steps
    for got, expected in zip(logits["triton"], logits["torch_native"], strict=True):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="needs CUDA and compiled Triton")
def test_cuda_graph_of_decode_replays_eager_results():
    """One captured decode graph (bs 4) replays batches of 4, 2 and 3 requests exactly."""
    backend, _ = _backends("cuda")
    allocator = KVAllocator(4096, torch.device("cuda"))
    rng = random.Random(13)
    batches = [_batch(backend, rng, allocator, ForwardMode.DECODE, n) for n in (4, 2, 3)]
    eager = [_run(backend, *batch).clone() for batch in batches]
    bs = 4
    static_q, static_k, static_v = (torch.zeros(bs, n * 64, device="cuda") for n in (8, 2, 2))
    static_loc = torch.zeros(bs, dtype=torch.int64, device="cuda")
    graph_batch = dataclasses.replace(batches[0][0], out_cache_loc=static_loc)
    backend.init_capture(max_bs=8)
    backend.prepare_for_replay(batches[0][0], bs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile the kernels outside the capture
        backend.forward(static_q, static_k, static_v, 0, graph_batch)
    torch.cuda.current_stream().wait_stream(side)
    backend.prepare_for_capture(bs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = backend.forward(static_q, static_k, static_v, 0, graph_batch)
    for (fb, q, k, v), expected in zip(batches, eager, strict=True):
        n = fb.batch_size
        backend.prepare_for_replay(fb, bs)
        for static, fresh in ((static_q, q), (static_k, k), (static_v, v), (static_loc,
                                                                          fb.out_cache_loc)):
            static.zero_()
            static[:n] = fresh
        graph.replay()
        torch.testing.assert_close(static_out[:n], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_long_splits_of_busy_batches_match_float64(device):
    """Large batches split a request's KV less (decode_config's min_split, max_splits): same
    output."""
    from lmnb.runtime.kernels.triton_decode import DecodeConfig, decode_config

    busy, idle = (decode_config(128, torch.bfloat16, batch_size=bs, num_kv_heads=8)
                  for bs in (256, 1))
    assert busy.min_split > idle.min_split and busy.max_splits < idle.max_splits
    gen = torch.Generator().manual_seed(3)
    seq_lens = [1, 70, 130, 300]
    kv_indptr, kv_indices = _ragged(seq_lens, device, gen)
    k_buffer, v_buffer = _pool(sum(seq_lens), 2, 64, torch.float32, device)
    q = torch.randn(len(seq_lens), 8, 64, device=device)
    # a long minimum split; then a split grid capped below the backend's max_kv_splits
    # and the loop's variants: next block's slots prefetched, K loaded token-major
    for config in (DecodeConfig(64, 256, 2, 2), DecodeConfig(64, 64, 2, 2, max_splits=2),
                   DecodeConfig(64, 64, 2, 2, prefetch=True),
                   DecodeConfig(64, 64, 2, 2, max_splits=2, prefetch=True, k_rows=True),
                   DecodeConfig(64, 64, 2, 2, heads_first=True),
                   # one split: every output from stage 1, the merge not launched
                   DecodeConfig(64, 64, 2, 2, max_splits=1, prefetch=True, k_rows=True,
                                heads_first=True)):
        out = torch.full_like(q, float("nan"))
        decode_attention(q, k_buffer, v_buffer, out, kv_indptr, kv_indices,
                         *partial_buffers(len(seq_lens), 8, 64, 4, q.device), scale=64**-0.5,
                         max_kv_splits=4, config=config)
        for i, n in enumerate(seq_lens):
            slots = kv_indices[kv_indptr[i]:kv_indptr[i] + n]
            expected = _reference(q[i:i + 1], k_buffer, v_buffer, slots, n - 1)
            torch.testing.assert_close(out[i:i + 1].double(), expected, atol=1e-4, rtol=1e-4)



def test_busy_batches_within_two_waves_take_the_smaller_tile():
    """From 512 (request, KV head) programs the 128-token tile, unless the batch fits two waves
    of 2 programs a multiprocessor: then 64-token tiles in one split (known SMs only)."""
    from lmnb.runtime.kernels.triton_decode import decode_config

    def pick(bs: int, sm_count: int | None, dtype: torch.dtype = torch.bfloat16):
        return decode_config(128, dtype, batch_size=bs, num_kv_heads=8, sm_count=sm_count)

    assert pick(64, None).block_n == 128 and pick(64, 114).block_n == 128
    two_waves = pick(64, 132)  # 512 programs, 528 places
    assert (two_waves.block_n, two_waves.num_warps, two_waves.max_splits) == (64, 4, 1)
    assert pick(66, 132).block_n == 64 and pick(67, 132).block_n == 128
    assert pick(63, 132) == pick(63, None)  # below the busy level: unchanged
    assert pick(256, 132) == pick(256, None)
    fp8 = torch.float8_e4m3fn
    assert pick(64, 132, fp8) == pick(64, None, fp8) and pick(64, None, fp8).block_n == 128


# ---- code generation for a real GPU, without one -------------------------------------------

_COMPILE_FOR_HOPPER = """
from lmnb.runtime.kernels import shared_prefix, triton_decode, triton_extend

dt = "bf16"
i64 = "*i64"
# (shared prefix, tile variant, one split merging the prefix's partials)
for skip, variant, merge in ((True, False, False), (False, False, False), (False, True, False),
                             (True, False, True)):
    compile(triton_decode._decode_partial_kernel,
            triton_decode.partial_kernel_types(q="*" + dt, kv="*" + dt, kv_scales=i64, index=i64),
            {"GROUP": 4, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_H": 16, "BLOCK_N": 64,
             "MAX_SPLITS": 1 if merge else 16, "MIN_SPLIT": 64, "PRECISION": "tf32",
             "UPCAST": False, "HAS_SKIP": skip, "KV_FP8": False, "PREFETCH": variant,
             "K_ROWS": variant, "HEADS_FIRST": variant},
            warps=2)
    compile(triton_decode._decode_merge_kernel,
            {"PART_O": "*fp32", "PART_LSE": "*fp32", "KV_INDPTR": i64, "KV_SKIP": i64,
             "PREFIX_PARTS": i64, "OUT": "*" + dt,
             **{n: "i32" for n in ("stride_pob", "stride_poh", "stride_pos", "stride_plb",
                                   "stride_plh", "stride_ot", "stride_oh", "num_heads")}},
            {"HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_N": 64, "MAX_SPLITS": 16, "BLOCK_S": 32,
             "MIN_SPLIT": 64, "HAS_SKIP": skip, "BLOCK_HEADS": 2})
for rows, tile in shared_prefix.PREFIX_TILES.items():  # every tile height the plan may pick
  compile(shared_prefix._shared_prefix_kernel,
        {"Q": "*" + dt, "K": "*" + dt, "V": "*" + dt, "KV_INDPTR": i64, "KV_INDICES": i64,
         "ITEMS": i64, "PART_O": "*fp32", "PART_LSE": "*fp32", "scale": "fp32",
         **{n: "i32" for n in ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt",
                               "stride_vh", "stride_pob", "stride_poh", "stride_pos",
                               "stride_plb", "stride_plh", "stride_item")}},
        {"GROUP": 4, "GROUP_P2": 4, "MEMBERS": rows // 4, "HEAD_DIM": 128, "BLOCK_D": 128,
         "BLOCK_M": rows, "BLOCK_N": tile.block_n, "SPLIT_OFFSET": 16, "HEAD": 4,
         "PRECISION": "tf32", "UPCAST": False}, warps=tile.num_warps)
for k_rows in (False, True):
  compile(triton_extend._extend_kernel,
        {"Q": "*" + dt, "K": "*" + dt, "V": "*" + dt, "K_SCALE": i64, "V_SCALE": i64,
         "OUT": "*" + dt, "QO_INDPTR": i64, "KV_INDPTR": i64, "KV_INDICES": i64,
         "scale": "fp32", "stride_st": "i32", "stride_sh": "i32",
         **{n: "i32" for n in ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt",
                               "stride_vh", "stride_ot", "stride_oh")}},
        {"GROUP": 4, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_M": 128, "BLOCK_N": 32,
         "PRECISION": "tf32", "UPCAST": False, "KV_FP8": False, "K_ROWS": k_rows})
print("compiled")
"""


@pytest.mark.skipif(not INTERPRET, reason="on a GPU the other tests compile the kernels")
def test_attention_kernels_compile_for_a_hopper_gpu():
    """The interpreter does not run Triton's code generation: compile the decode (with and
    without a shared prefix), merge, shared-prefix and extend kernels for sm_90 ahead of time
    (no GPU needed) in a process without TRITON_INTERPRET."""
    assert_compiles_for_sm90(_COMPILE_FOR_HOPPER)


@pytest.mark.parametrize("device", DEVICES)
def test_extend_rows_past_int32_element_offsets(device):
    """int32 metadata (a pool whose offsets fit: `kernel_index_dtype`) with q/out rows whose
    element offsets pass 2^31 (a long prefill: tokens x heads x head_dim), here through a row
    stride of 2^30 elements: rows are addressed in 64 bits (in 32 the last row's offset wraps
    negative: an illegal address, a segfault in the interpreter). The 4 GiB buffer stays
    untouched but for its three rows (no memory is committed to the rest)."""
    heads, kv_heads, head_dim, n = 2, 1, 64, 3
    width, row = heads * head_dim, 2**30
    buffer = torch.empty((n - 1) * row + 2 * width, dtype=torch.float16, device=device)
    q, out = (buffer.as_strided((n, heads, head_dim), (row, head_dim, 1), offset)
              for offset in (0, width))  # row i: q's then out's, token 2 from element 2^31
    q.copy_(torch.randn(n, heads, head_dim, device=device))
    out.zero_()
    k_buffer, v_buffer = _pool(n, kv_heads, head_dim, torch.float16, device)
    indptr = torch.tensor([0, n], dtype=torch.int32, device=device)
    slots = torch.arange(1, n + 1, dtype=torch.int32, device=device)
    extend_attention(q, k_buffer, v_buffer, out, indptr, indptr, slots, max_extend_len=n,
                     scale=head_dim**-0.5)
    expected = _reference(q, k_buffer, v_buffer, slots.long(), 0)
    tol = TOLERANCE[torch.float16]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_kernels_get_int32_metadata_eager_and_replayed(device, monkeypatch):
    """int64 indptrs and slots make the kernels' address and mask arithmetic 64-bit (1.6x slower
    prefill attention on an H200): the backend hands them int32 for a pool that fits."""
    from lmnb.runtime.kernels import triton_backend as tb

    seen: list[torch.dtype] = []

    def recording(kernel):
        def call(q, k_buffer, v_buffer, out, *index, **kwargs):
            seen.extend(t.dtype for t in index if isinstance(t, torch.Tensor)
                        and t.dtype in (torch.int32, torch.int64))
            return kernel(q, k_buffer, v_buffer, out, *index, **kwargs)
        return call

    monkeypatch.setattr(tb, "extend_attention", recording(tb.extend_attention))
    monkeypatch.setattr(tb, "decode_attention", recording(tb.decode_attention))
    backend, _ = _backends(device)
    allocator = KVAllocator(4096, torch.device(device))
    rng = random.Random(4)
    for mode in (ForwardMode.EXTEND, ForwardMode.DECODE):
        _run(backend, *_batch(backend, rng, allocator, mode, 3))
    fb, q, k, v = _batch(backend, rng, allocator, ForwardMode.DECODE, 2)
    backend.init_capture(max_bs=4, kv_capacity=600)
    backend.prepare_for_replay(fb, 2)
    backend.forward(q, k, v, 0, fb)
    assert len(seen) == 3 + 2 + 2 and set(seen) == {torch.int32}  # extend, decode, replay
