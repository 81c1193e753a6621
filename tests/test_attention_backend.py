"""Attention backends against a per-request reference; metadata builders; capture/replay hooks."""

from __future__ import annotations

import dataclasses
import importlib.util
import random
import weakref
from dataclasses import dataclass

import pytest
import torch

from lmnb.runtime.config import EngineConfig
from lmnb.runtime.core import ForwardMode
from lmnb.runtime.forward_batch import ForwardBatch
from lmnb.runtime.graph_runner import DecodeGraphRunner
from lmnb.runtime.kernels.base import AttentionBackend
from lmnb.runtime.kernels.metadata import DecodeBuffers, build_kv_indices, padded_kv_slots
from lmnb.runtime.kernels.registry import (
    attention_backend_class,
    available_attention_backends,
    create_attention_backend,
    fp8_kv_scales,
    select_attention_backend,
)
from lmnb.runtime.memory import KVAllocator, KVStorage, ReqToTokenPool
from lmnb.runtime.models.layers.attention import PooledAttention, bound_to

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]
SHAPES = [(4, 4, 64), (8, 2, 128), (4, 1, 64)]  # (heads, kv_heads, head_dim): GQA 1, 4, 4
POOL_SIZE = 4096


@dataclass
class Case:
    backend: AttentionBackend
    mode: ForwardMode
    prefix_lens: list[int]
    extend_lens: list[int]
    pool_indices: list[int]
    out_cache_loc: torch.Tensor
    q: torch.Tensor  # [num_tokens, heads * dim]
    k: torch.Tensor  # [num_tokens, kv_heads * dim]
    v: torch.Tensor

    def forward_batch(self) -> ForwardBatch:
        return ForwardBatch.build(
            mode=self.mode, input_ids=[0] * self.q.shape[0], req_pool_indices=self.pool_indices,
            prefix_lens=self.prefix_lens, extend_lens=self.extend_lens,
            out_cache_loc=self.out_cache_loc,
            req_to_token=self.backend.req_to_token_pool.req_to_token)


_ALLOCATORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # backend -> its slots


def _backend(heads: int, kv_heads: int, head_dim: int, device: str,
             max_reqs: int = 32, max_context: int = 256) -> AttentionBackend:
    return attention_backend_class("torch_native")(
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        req_to_token_pool=ReqToTokenPool(max_reqs, max_context, torch.device(device)),
        kv_storage=KVStorage(POOL_SIZE, num_layers=1, kv_heads=kv_heads,
                                       head_dim=head_dim, dtype=torch.float32,
                                       device=torch.device(device)))


def _case(backend: AttentionBackend, rng: random.Random, *, mode: ForwardMode, bs: int,
          max_prefix: int = 100, max_extend: int = 40) -> Case:
    """A ragged batch over scattered KV slots; the cached prefixes' K/V are random.

    Requests and slots come from the pools' allocators, so cases of one backend never overlap.
    """
    device = backend.req_to_token_pool.req_to_token.device
    allocator = _ALLOCATORS.setdefault(backend, KVAllocator(backend.kv_storage.size,
                                                            torch.device(device)))
    pool = backend.kv_storage
    prefix_lens = [rng.choice([0, rng.randint(1, max_prefix)]) for _ in range(bs)]
    if mode is ForwardMode.DECODE:
        prefix_lens = [max(p, rng.randint(0, 3)) for p in prefix_lens]
        extend_lens = [1] * bs
    else:
        extend_lens = [rng.randint(1, max_extend) for _ in range(bs)]
    pool_indices = [backend.req_to_token_pool.alloc() for _ in range(bs)]
    taken = allocator.alloc(sum(prefix_lens) + sum(extend_lens))
    order = torch.randperm(len(taken), generator=torch.Generator().manual_seed(rng.randrange(99)))
    free, start = taken[order.to(device)], 0  # scattered, not in allocation order
    new_slots = []
    for idx, prefix, extend in zip(pool_indices, prefix_lens, extend_lens, strict=True):
        slots = free[start:start + prefix + extend]
        start += prefix + extend
        backend.req_to_token_pool.req_to_token[idx, :prefix + extend] = slots
        new_slots.append(slots[prefix:])
        shape = (prefix, backend.num_kv_heads, backend.head_dim)
        pool.k_buffers[0][slots[:prefix]] = torch.randn(shape, device=device).to(pool.dtype)
        pool.v_buffers[0][slots[:prefix]] = torch.randn(shape, device=device).to(pool.dtype)
    tokens = sum(extend_lens)
    return Case(backend=backend, mode=mode, prefix_lens=prefix_lens, extend_lens=extend_lens,
                pool_indices=pool_indices, out_cache_loc=torch.cat(new_slots),
                q=torch.randn(tokens, backend.num_heads * backend.head_dim, device=device),
                k=torch.randn(tokens, backend.num_kv_heads * backend.head_dim, device=device),
                v=torch.randn(tokens, backend.num_kv_heads * backend.head_dim, device=device))


def _reference(case: Case) -> torch.Tensor:
    """Per request in float64: softmax(q k^T * scale) v over prefix + new tokens, causal."""
    backend = case.backend
    heads, kv_heads, dim = backend.num_heads, backend.num_kv_heads, backend.head_dim
    pool = backend.kv_storage
    out, start = [], 0
    for idx, prefix, extend in zip(case.pool_indices, case.prefix_lens, case.extend_lens,
                                   strict=True):
        cached = backend.req_to_token_pool.req_to_token[idx, :prefix]
        keys = torch.cat((pool.k_buffers[0][cached].flatten(1),
                          case.k[start:start + extend])).double().view(-1, kv_heads, dim)
        values = torch.cat((pool.v_buffers[0][cached].flatten(1),
                            case.v[start:start + extend])).double().view(-1, kv_heads, dim)
        keys = keys.repeat_interleave(heads // kv_heads, dim=1)  # [seq, heads, dim]
        values = values.repeat_interleave(heads // kv_heads, dim=1)
        query = case.q[start:start + extend].double().view(extend, heads, dim)
        scores = torch.einsum("qhd,khd->hqk", query, keys) * dim**-0.5
        positions = torch.arange(prefix, prefix + extend, device=keys.device)
        allowed = torch.arange(prefix + extend, device=keys.device)[None, :] <= positions[:, None]
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        out.append(torch.einsum("hqk,khd->qhd", weights, values).reshape(extend, heads * dim))
        start += extend
    return torch.cat(out).float()


def _run(case: Case) -> torch.Tensor:
    forward_batch = case.forward_batch()
    case.backend.init_forward_metadata(forward_batch)
    return case.backend.forward(case.q, case.k, case.v, 0, forward_batch)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES)
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_backend_matches_per_request_reference(device, heads, kv_heads, head_dim, mode):
    backend = _backend(heads, kv_heads, head_dim, device)
    rng = random.Random(heads * 1000 + head_dim + int(mode is ForwardMode.DECODE))
    for bs in (1, 3, 7):
        case = _case(backend, rng, mode=mode, bs=bs)
        got = _run(case)
        assert got.shape == case.q.shape
        torch.testing.assert_close(got, _reference(case), atol=2e-5, rtol=2e-5)
        # The new tokens' K/V were written to their slots.
        kv_heads_dim = (len(case.out_cache_loc), kv_heads, head_dim)
        torch.testing.assert_close(backend.kv_storage.k_buffers[0][case.out_cache_loc],
                                   case.k.view(kv_heads_dim), atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_metadata_matches_python_reference(device):
    backend = _backend(4, 2, 64, device)
    rng = random.Random(7)
    for mode in (ForwardMode.EXTEND, ForwardMode.DECODE):
        case = _case(backend, rng, mode=mode, bs=6)
        fb = case.forward_batch()
        table = backend.req_to_token_pool.req_to_token.tolist()
        seq_lens = [p + e for p, e in zip(case.prefix_lens, case.extend_lens, strict=True)]
        kv_indices = [slot for idx, n in zip(case.pool_indices, seq_lens, strict=True)
                      for slot in table[idx][:n]]
        positions = [pos for p, e in zip(case.prefix_lens, case.extend_lens, strict=True)
                     for pos in range(p, p + e)]
        indptr = [0]
        for n in seq_lens:
            indptr.append(indptr[-1] + n)
        qo_indptr = [0]
        for n in case.extend_lens:
            qo_indptr.append(qo_indptr[-1] + n)
        assert fb.kv_indices.tolist() == kv_indices
        assert fb.kv_indptr.tolist() == indptr
        assert fb.qo_indptr.tolist() == qo_indptr
        assert fb.positions.tolist() == positions
        assert fb.seq_lens.tolist() == fb.seq_lens_cpu == seq_lens
        assert fb.num_kv_tokens == len(kv_indices)
        assert fb.req_pool_indices.tolist() == case.pool_indices
        assert fb.input_ids.tolist() == [0] * len(positions)
        given = ForwardBatch.build(
            mode=mode, input_ids=torch.arange(len(positions), dtype=torch.int32),
            req_pool_indices=case.pool_indices, prefix_lens=case.prefix_lens,
            extend_lens=case.extend_lens, out_cache_loc=case.out_cache_loc,
            req_to_token=backend.req_to_token_pool.req_to_token)
        assert given.input_ids.tolist() == list(range(len(positions)))
        assert given.input_ids.dtype == torch.int64 and given.positions.tolist() == positions


def test_padded_kv_slots_pads_with_the_padding_slot():
    kv_indices = torch.tensor([5, 6, 7, 9, 4])
    kv_indptr = torch.tensor([0, 3, 3 + 1, 5])
    seq_lens = torch.tensor([3, 1, 1])
    slots, valid = padded_kv_slots(kv_indptr, kv_indices, seq_lens, 4)
    assert slots.tolist() == [[5, 6, 7, 0], [9, 0, 0, 0], [4, 0, 0, 0]]
    assert valid.tolist() == [[True, True, True, False], [True, False, False, False],
                              [True, False, False, False]]
    table = torch.arange(40).view(4, 10)
    got = build_kv_indices(table, torch.tensor([2, 0]), torch.tensor([3, 2]),
                           torch.tensor([0, 3, 5]), 5)
    assert got.tolist() == [20, 21, 22, 0, 1]


def test_decode_buffers_pad_with_dummy_rows_and_keep_their_addresses():
    buffers = DecodeBuffers(max_bs=6, kv_capacity=12, device=torch.device("cpu"))
    pointers = [t.data_ptr() for t in (buffers.seq_lens, buffers.kv_indptr, buffers.kv_indices)]
    buffers.fill(seq_lens=torch.tensor([2, 3, 1, 2, 2]),
                 kv_indptr=torch.tensor([0, 2, 5, 6, 8, 10]),
                 kv_indices=torch.arange(11, 21), num_kv_tokens=10, bs=6)
    buffers.fill(seq_lens=torch.tensor([3, 1]), kv_indptr=torch.tensor([0, 3, 4]),
                 kv_indices=torch.tensor([7, 8, 9, 4]), num_kv_tokens=4, bs=5)
    assert buffers.seq_lens[:5].tolist() == [3, 1, 1, 1, 1]
    assert buffers.kv_indptr[:6].tolist() == [0, 3, 4, 5, 6, 7]
    assert buffers.kv_indices[:7].tolist() == [7, 8, 9, 4, 0, 0, 0]
    assert pointers == [t.data_ptr() for t in (buffers.seq_lens, buffers.kv_indptr,
                                                buffers.kv_indices)]
    assert not buffers.fits(2, 13)
    with pytest.raises(ValueError, match="does not fit"):
        buffers.fill(seq_lens=torch.tensor([13]), kv_indptr=torch.tensor([0, 13]),
                     kv_indices=torch.arange(13), num_kv_tokens=13, bs=1)
    with pytest.raises(ValueError, match="does not fit"):
        buffers.fill(seq_lens=torch.tensor([1, 1]), kv_indptr=torch.tensor([0, 1, 2]),
                     kv_indices=torch.arange(2), num_kv_tokens=2, bs=1)


def _padded(case: Case, bs: int) -> tuple[torch.Tensor, ...]:
    """q/k/v/out_cache_loc grown to `bs` rows as a graph runner would: junk rows, slot 0."""
    extra = bs - case.q.shape[0]
    q, k, v = (torch.cat((t, torch.randn(extra, t.shape[1], device=t.device)))
               for t in (case.q, case.k, case.v))
    loc = torch.cat((case.out_cache_loc, case.out_cache_loc.new_zeros(extra)))
    return q, k, v, loc


@pytest.mark.parametrize("device", DEVICES)
def test_capture_then_replay_equals_eager_decode(device):
    backend = _backend(8, 2, 64, device)
    assert backend.supports_capture
    rng = random.Random(3)
    first = _case(backend, rng, mode=ForwardMode.DECODE, bs=4)
    second = _case(backend, rng, mode=ForwardMode.DECODE, bs=2)
    eager_first, eager_second = _run(first), _run(second)

    backend.init_capture(max_bs=8)
    backend.prepare_for_capture(6)
    for case, eager in ((first, eager_first), (second, eager_second), (first, eager_first)):
        forward_batch = case.forward_batch()
        backend.prepare_for_replay(forward_batch, 6)
        q, k, v, loc = _padded(case, 6)
        forward_batch.out_cache_loc = loc  # the static buffer a graph would read
        got = backend.forward(q, k, v, 0, forward_batch)
        assert got.shape == (6, q.shape[1])
        torch.testing.assert_close(got[:case.q.shape[0]], eager, atol=1e-5, rtol=1e-5)
        assert torch.isfinite(got).all()  # padded rows read the finite padding slot
        # An eager step in between must not leave the next replay pointing at its tensors.
        _run(second)


@pytest.mark.parametrize("device", DEVICES)
def test_replay_without_padding_and_static_buffers_stay_put(device):
    backend = _backend(4, 4, 128, device)
    rng = random.Random(5)
    case = _case(backend, rng, mode=ForwardMode.DECODE, bs=3)
    eager = _run(case)
    backend.init_capture(max_bs=4, max_kv_len=backend.req_to_token_pool.max_context_len)
    backend.prepare_for_capture(3)
    captured = backend._slots.data_ptr(), backend._mask.data_ptr()
    backend.prepare_for_replay(case.forward_batch())
    assert (backend._slots.data_ptr(), backend._mask.data_ptr()) == captured
    torch.testing.assert_close(backend.forward(case.q, case.k, case.v, 0, case.forward_batch()),
                               eager, atol=1e-5, rtol=1e-5)


def test_registry_by_name_auto_and_unknown():
    assert "torch_native" in available_attention_backends()
    assert select_attention_backend("torch_native", torch.device("cpu")).name == "torch_native"
    choice = select_attention_backend("auto", torch.device("cpu"))
    assert choice.name == "torch_native" and "cuda" in choice.reason.lower()
    # On CUDA, auto tries FlashInfer (fp16/bf16 only), then Triton, then torch-native.
    installed = {name: importlib.util.find_spec(name) is not None
                 for name in ("flashinfer", "triton")}
    half = select_attention_backend("auto", torch.device("cuda"), dtype=torch.bfloat16,
                                    head_dim=128)
    fp32 = select_attention_backend("auto", torch.device("cuda"), dtype=torch.float32,
                                    head_dim=128)
    fallback = "triton" if installed["triton"] else "torch_native"
    assert half.name == ("flashinfer" if installed["flashinfer"] else fallback)
    assert fp32.name == fallback
    if fallback == "torch_native":  # the reason names every backend passed over, and why
        assert "flashinfer" in fp32.reason and "triton" in fp32.reason
        if installed["flashinfer"]:
            assert "fp16/bf16" in fp32.reason
    with pytest.raises(ValueError, match="torch_native") as error:
        select_attention_backend("flashattention9", torch.device("cpu"))
    assert "auto" in str(error.value)
    backend = create_attention_backend(
        select_attention_backend("auto", torch.device("cpu")), num_heads=2, num_kv_heads=1,
        head_dim=8, req_to_token_pool=ReqToTokenPool(2, 8, torch.device("cpu")),
        kv_storage=KVStorage(8, num_layers=1, kv_heads=1, head_dim=8,
                                       dtype=torch.float32, device=torch.device("cpu")))
    assert type(backend).__name__ == "TorchNativeAttention"
    assert backend.choice is not None and backend.choice.name == "torch_native"


def test_auto_keeps_per_token_fp8_scales_and_flashinfer_reads_fixed_ones(monkeypatch):
    """FlashInfer reads an FP8 pool with one scale per tensor: "auto" passes over it for FP8
    KV (Triton keeps per-token scales), the pool asked for by its name has fixed scales."""
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: (
        object() if name == "flashinfer" else found(name, *args)))  # as if installed
    cuda, fp8 = torch.device("cuda"), torch.float8_e4m3fn
    assert select_attention_backend("auto", cuda, dtype=torch.bfloat16,
                                    head_dim=128).name == "flashinfer"
    choice = select_attention_backend("auto", cuda, dtype=fp8, head_dim=128)
    assert choice.name == ("triton" if found("triton") else "torch_native")
    if choice.name == "torch_native":
        assert "flashinfer: reads an FP8 KV pool with one scale per tensor" in choice.reason
    for name, scales in (("auto", "token"), ("flashinfer", "tensor"), ("torch_native", "token")):
        chosen = select_attention_backend(name, cuda, dtype=fp8, head_dim=128)
        assert fp8_kv_scales(chosen) == scales, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_metadata_and_replay_never_sync_the_host():
    backend = _backend(8, 2, 64, "cuda")
    case = _case(backend, random.Random(11), mode=ForwardMode.DECODE, bs=5)
    backend.init_capture(max_bs=8)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        forward_batch = case.forward_batch()
        backend.init_forward_metadata(forward_batch)
        backend.prepare_for_replay(forward_batch, 8)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_model_decode_through_capture_hooks_matches_eager(tiny_models):
    """A whole model's decode step as a graph runner would replay it (padded to bs, static
    buffers) gives the eager step's logits; no CUDA graph on CPU, the hooks are what is tested."""
    from lmnb.runtime.model_runner import ModelRunner
    from lmnb.runtime.models import loader

    folder = tiny_models["llama-gqa"]
    config = loader.load_model_config(folder)
    model = loader.load_model(folder, config, dtype=torch.float32, device=torch.device("cpu"))
    runner = ModelRunner(model, config, EngineConfig(max_total_tokens=512, max_running_requests=8,
                                                     attention_backend="auto"),
                         device=torch.device("cpu"), dtype=torch.float32, eos_token_ids={2})
    # the runner's backend (owning its pools) is bound to every attention layer, once
    assert bound_to(model, runner.attn_backend)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(3, 30))] for _ in range(3)]
    table = runner.req_to_token_pool.req_to_token
    indices = [runner.req_to_token_pool.alloc() for _ in prompts]
    lens = [len(ids) for ids in prompts]
    slots = KVAllocator(512, torch.device("cpu")).alloc(sum(lens) + len(prompts))
    for i, (idx, n) in enumerate(zip(indices, lens, strict=True)):
        start = sum(lens[:i]) + i
        runner.req_to_token_pool.req_to_token[idx, :n + 1] = slots[start:start + n + 1]
    prefill_loc = torch.cat([slots[sum(lens[:i]) + i:sum(lens[:i + 1]) + i]
                             for i in range(len(lens))])
    decode_loc = torch.stack([slots[sum(lens[:i + 1]) + i] for i in range(len(lens))])

    def step(fb: ForwardBatch) -> torch.Tensor:
        return model.compute_logits(model(fb.input_ids, fb.positions, fb))

    with torch.inference_mode():
        prefill = ForwardBatch.build(mode=ForwardMode.EXTEND, input_ids=sum(prompts, []),
                                     req_pool_indices=indices, prefix_lens=[0] * 3,
                                     extend_lens=lens, out_cache_loc=prefill_loc,
                                     req_to_token=table)
        runner.attn_backend.init_forward_metadata(prefill)
        step(prefill)
        decode = ForwardBatch.build(mode=ForwardMode.DECODE, input_ids=[5, 6, 7],
                                    req_pool_indices=indices, prefix_lens=lens,
                                    extend_lens=[1] * 3, out_cache_loc=decode_loc,
                                    req_to_token=table)
        runner.attn_backend.init_forward_metadata(decode)
        eager = step(decode)

        bs = 4
        runner.attn_backend.init_capture(max_bs=8)
        runner.attn_backend.prepare_for_capture(bs)
        runner.attn_backend.prepare_for_replay(decode, bs)
        zero = torch.zeros(1, dtype=torch.int64)
        padded = dataclasses.replace(decode, batch_size=bs,
                                     input_ids=torch.cat((decode.input_ids, zero)),
                                     positions=torch.cat((decode.positions, zero)),
                                     out_cache_loc=torch.cat((decode.out_cache_loc, zero)))
        replayed = step(padded)
    assert replayed.shape[0] == bs
    torch.testing.assert_close(replayed[:3], eager, atol=1e-5, rtol=1e-5)
    runner.close()  # unbinds: the model keeps no pool alive
    assert all(m.attn_backend is None for m in model.modules() if isinstance(m, PooledAttention))
    with pytest.raises(ValueError, match="not bound to this backend"):  # before any CUDA call
        DecodeGraphRunner(model, runner.attn_backend, max_bs=1, device=torch.device("cpu"))


def test_triton_metadata_is_int32_while_every_pool_offset_fits():
    from lmnb.runtime.kernels.triton_backend import kernel_index_dtype

    assert kernel_index_dtype(2**31 - 1) is torch.int32
    assert kernel_index_dtype(2**31) is torch.int64


def test_decode_buffers_cast_the_batch_to_their_index_dtype():
    buffers = DecodeBuffers(4, 16, torch.device("cpu"), index_dtype=torch.int32)
    buffers.fill(seq_lens=torch.tensor([3, 2]), kv_indptr=torch.tensor([0, 3, 5]),
                 kv_indices=torch.tensor([7, 8, 9, 4, 5]), num_kv_tokens=5, bs=4)
    assert buffers.kv_indptr.dtype == buffers.kv_indices.dtype == torch.int32
    assert buffers.kv_indptr.tolist() == [0, 3, 5, 6, 7]  # two dummy rows of one slot each
    assert buffers.kv_indices[:7].tolist() == [7, 8, 9, 4, 5, 0, 0]
