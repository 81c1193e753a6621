"""KV pool sizing: a profile run measures the heaviest passes before the pool exists.

    weights | fixed (req_to_token, backend buffers) | KV pool | activations | graphs | margin
    <------------------------------ device total ------------------------------------------->

`profile_activations` runs, with temporary pools, an EXTEND pass of the largest prefill chunk
(logits + sampling of its sampled rows), a DECODE pass at `max_running_requests` rows (logits +
sampling), and the decode forward + logits at the graphs' largest batch, and measures each peak
(`MemoryMeter`). `plan_kv_pool` turns the numbers into KV tokens: what is free, less the measured
needs and a safety margin; or, with `mem_fraction_static` (SGLang's meaning: that fraction of the
device for weights + KV), that fraction, checked against the measured needs.
"""

from __future__ import annotations

import functools
import gc
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch

from lmnb.params import SamplingParams
from lmnb.runtime.core import ForwardMode
from lmnb.runtime.forward_batch import ForwardBatch
from lmnb.runtime.graph_runner import SHARED_MIN_BS, batch_size_ladder
from lmnb.runtime.kernels.base import AttentionBackend, BackendChoice
from lmnb.runtime.kernels.precompile import compile_side_by_side
from lmnb.runtime.kernels.registry import create_attention_backend, fp8_kv_scales
from lmnb.runtime.memory import KVStorage, ReqToTokenPool
from lmnb.runtime.models.layers.attention import bind_attention_backend
from lmnb.runtime.sampling import Sampler

SAFETY_MARGIN_FRACTION = 0.04  # of the device's total memory, never planned for
# torch-native attention gathers every request's padded K/V per layer (and masks a chunk behind
# a long prefix densely): transient memory that grows with context and batch, beyond what the
# profile's short passes reach; with it, at least this share of the device stays for activations.
TORCH_NATIVE_ACTIVATION_FRACTION = 0.15
MIN_SAFETY_MARGIN = 512 << 20
# Per KV token beside its K/V: the allocator's int64 free list (twice while `free` concatenates)
# and the prefix cache's int64 slot index.
SLOT_BOOKKEEPING_BYTES = 24
CPU_KV_MEMORY_FRACTION = 0.15  # of the host's available memory, when no size is given on CPU
CPU_MAX_DEFAULT_TOKENS = 65536
GIB = 1 << 30


class MemoryMeter(Protocol):
    """Device memory readings for the profile (`CudaMeter`; tests pass fakes)."""

    def device_memory(self) -> tuple[int, int]:
        """(free, total) bytes of the device now."""

    def allocated(self) -> int:
        """Bytes held by live tensors now."""

    def start(self) -> None:
        """Begin a measurement: drop cached blocks, reset the peaks."""

    def peak(self) -> int:
        """Bytes above the level at `start` the allocator needed at its peak since then."""


class CudaMeter:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._allocated = self._reserved = 0

    def device_memory(self) -> tuple[int, int]:
        gc.collect()  # the temporary pools and backend, should a cycle hold them
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(self.device)

    def allocated(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device)

    def start(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._allocated = torch.cuda.memory_allocated(self.device)
        self._reserved = torch.cuda.memory_reserved(self.device)

    def peak(self) -> int:
        # Reserved covers the caching allocator's rounding and fragmentation at the peak.
        torch.cuda.synchronize(self.device)
        return max(torch.cuda.max_memory_allocated(self.device) - self._allocated,
                   torch.cuda.max_memory_reserved(self.device) - self._reserved, 0)


def default_meter(device: torch.device) -> MemoryMeter | None:
    """The meter a runner on `device` profiles with (None: no profile, the CPU policy)."""
    return CudaMeter(device) if device.type == "cuda" else None


@dataclass(frozen=True)
class ActivationProfile:
    """Measured bytes (see the module docstring)."""

    prefill_bytes: int  # EXTEND of the largest chunk + logits + sampling
    decode_bytes: int  # DECODE at max_running_requests + logits + sampling
    graph_pool_bytes: int  # decode forward + logits at the graphs' max batch (their pool)
    graph_static_bytes: int  # backend capture buffers + the ladder's other logits outputs
    fixed_bytes: int  # a req_to_token pool and an attention backend, before any pass
    seconds: float

    @property
    def activation_bytes(self) -> int:
        return max(self.prefill_bytes, self.decode_bytes)

    @property
    def graph_bytes(self) -> int:
        return self.graph_pool_bytes + self.graph_static_bytes if self.graph_pool_bytes else 0


@dataclass(frozen=True)
class MemoryPlan:
    """How the device's memory is shared out (bytes), and the KV pool that results."""

    total_bytes: int
    weight_bytes: int
    activation_bytes: int
    graph_bytes: int
    fixed_bytes: int
    margin_bytes: int
    kv_tokens: int
    bytes_per_token: int
    mem_fraction_static: float | None
    profile_seconds: float = 0.0

    @property
    def kv_bytes(self) -> int:
        """The pool and its slot bookkeeping."""
        return self.kv_tokens * (self.bytes_per_token + SLOT_BOOKKEEPING_BYTES)

    def with_tokens(self, kv_tokens: int) -> MemoryPlan:
        return MemoryPlan(**{**asdict(self), "kv_tokens": kv_tokens})

    def report(self) -> dict[str, float | int | None]:
        """GB figures for `stats()['memory']`."""
        def gb(n: int) -> float:
            return round(n / GIB, 3)

        return {"total_gb": gb(self.total_bytes), "weights_gb": gb(self.weight_bytes),
                "kv_gb": gb(self.kv_bytes), "kv_tokens": self.kv_tokens,
                "activations_peak_gb": gb(self.activation_bytes),
                "cuda_graph_reserve_gb": gb(self.graph_bytes), "fixed_gb": gb(self.fixed_bytes),
                "margin_gb": gb(self.margin_bytes),
                "mem_fraction_static": self.mem_fraction_static,
                "profile_seconds": round(self.profile_seconds, 3)}


def safety_margin(total: int) -> int:
    return max(int(total * SAFETY_MARGIN_FRACTION), MIN_SAFETY_MARGIN)


def plan_kv_pool(*, total: int, free: int, weights: int, activations: int, graphs: int,
                 fixed: int, per_token: int, mem_fraction_static: float | None,
                 margin: int | None = None, profile_seconds: float = 0.0) -> MemoryPlan:
    """KV tokens for a device with `total` bytes of which `free` are free now (weights loaded,
    nothing else of this runtime allocated). Without `mem_fraction_static`: what is free less
    `fixed` + `activations` + `graphs` + the margin. With it: weights + KV fill that fraction of
    `total`; a ValueError when what is left cannot hold the measured needs, a warning when it
    holds them but not the margin. ValueError when fewer than 2 tokens fit. A token costs
    `per_token` (its K/V) + SLOT_BOOKKEEPING_BYTES."""
    margin = safety_margin(total) if margin is None else margin
    needs = fixed + activations + graphs
    if mem_fraction_static is None:
        budget = free - needs - margin
    else:
        budget = int(total * mem_fraction_static) - (total - free)
    tokens = max(budget // (per_token + SLOT_BOOKKEEPING_BYTES), 0)
    if tokens < 2:
        raise ValueError(
            f"no memory left for the KV cache: {free / GIB:.2f} GB free of {total / GIB:.2f} GB"
            f" after the weights, {needs / GIB:.2f} GB needed for activations, CUDA graphs and "
            f"buffers" + (f", mem_fraction_static={mem_fraction_static}"
                          if mem_fraction_static is not None else
                          f", {margin / GIB:.2f} GB margin")
            + " (a smaller chunked_prefill_size or max_running_requests needs less)")
    if mem_fraction_static is not None:
        left = free - tokens * (per_token + SLOT_BOOKKEEPING_BYTES)
        if left < needs:
            raise ValueError(
                f"mem_fraction_static={mem_fraction_static} leaves {left / GIB:.2f} GB beside "
                f"weights + KV, but the profile run needs {needs / GIB:.2f} GB (activations "
                f"{activations / GIB:.2f}, CUDA graphs {graphs / GIB:.2f}, buffers "
                f"{fixed / GIB:.2f}): lower it, or leave it unset to size the pool from the "
                f"profile")
        if left < needs + margin:
            warnings.warn(
                f"mem_fraction_static={mem_fraction_static} leaves {left / GIB:.2f} GB beside "
                f"weights + KV: the measured needs ({needs / GIB:.2f} GB) fit, the "
                f"{margin / GIB:.2f} GB safety margin does not", RuntimeWarning, stacklevel=2)
    return MemoryPlan(total_bytes=total, weight_bytes=weights, activation_bytes=activations,
                      graph_bytes=graphs, fixed_bytes=fixed, margin_bytes=margin,
                      kv_tokens=tokens, bytes_per_token=per_token,
                      mem_fraction_static=mem_fraction_static, profile_seconds=profile_seconds)


def cpu_kv_tokens(*, available: int, per_token: int, mem_fraction_static: float | None) -> int:
    """The CPU policy (no profile): that fraction (default 15%, at most 65536 tokens unless the
    fraction is given) of the host's available memory."""
    fraction = CPU_KV_MEMORY_FRACTION if mem_fraction_static is None else mem_fraction_static
    tokens = int(available * fraction // per_token)
    if mem_fraction_static is None:
        tokens = min(tokens, CPU_MAX_DEFAULT_TOKENS)
    if tokens < 2:
        raise ValueError(f"no memory left for the KV cache (mem_fraction_static={fraction})")
    return tokens


@dataclass(frozen=True)
class ProfileShape:
    """What the profile runs: the engine's largest passes."""

    prefill_tokens: int  # the scheduler's chunk: tokens of the largest EXTEND pass
    max_running_requests: int  # rows of the largest DECODE pass
    graph_max_bs: int  # 0: no decode graphs
    context_len: int  # req_to_token width - 1 (the backends size capture buffers by it)


@dataclass
class _ProfileRow:
    """A `SamplingRow` that takes the sampler's heaviest path (top-p over the whole vocabulary on
    CUDA, penalties, min-p, logprobs, the logprobs of named ids: one more log-softmax)."""

    sampling_params: SamplingParams
    origin_input_ids: list[int]
    output_ids: list[int]
    generator: None = None
    grammar: None = None
    return_logprob: bool = True
    top_logprobs_num: int = 5
    token_ids_logprob: list[int] | None = field(default_factory=lambda: [0, 1])
    rid: int | None = None


def _heavy_rows(n: int, vocab_size: int) -> list[_ProfileRow]:
    params = SamplingParams(temperature=0.8, top_p=0.9, min_p=0.05, frequency_penalty=0.1,
                            presence_penalty=0.1, repetition_penalty=1.1)
    return [_ProfileRow(params, [(7 * i + j) % vocab_size for j in range(4)], [i % vocab_size])
            for i in range(n)]


@torch.inference_mode()
def profile_activations(model: torch.nn.Module, shape: ProfileShape, meter: MemoryMeter, *,
                        attention_backend: BackendChoice, q_heads: int, kv_heads: int,
                        head_dim: int, num_layers: int, dtype: torch.dtype, device: torch.device,
                        vocab_size: int, sampler: Sampler,
                        kv_dtype: torch.dtype | None = None) -> ActivationProfile:
    """Runs the profile passes with temporary pools (freed on return: the model's attention
    layers are bound to them for the passes, then unbound)."""
    start = time.perf_counter()
    base = meter.allocated()
    req_pool = ReqToTokenPool(shape.max_running_requests, shape.context_len + 1, device)
    with_pool = meter.allocated()
    storage = KVStorage(shape.prefill_tokens + 2 * shape.max_running_requests,
                        num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim,
                        dtype=kv_dtype or dtype, device=device, compute_dtype=dtype,
                        fp8_scales=fp8_kv_scales(attention_backend))
    with_storage = meter.allocated()
    backend = create_attention_backend(
        attention_backend, num_heads=q_heads, num_kv_heads=kv_heads, head_dim=head_dim,
        req_to_token_pool=req_pool, kv_storage=storage)
    fixed = with_pool - base + meter.allocated() - with_storage
    run = _PassRunner(model, backend, req_pool, sampler, vocab_size)
    bind_attention_backend(model, backend)
    try:
        if device.type == "cuda":  # the passes' kernels (sampling's too) compiled side by side
            # first; safe to skip launches: the sampler's kernels address memory only through
            # host-built rows and `packed_logprobs` clamps the ids it reads at
            compile_side_by_side(functools.partial(run.passes, shape, meter), device)
        prefill, decode, graph_pool = run.passes(shape, meter)
    finally:
        bind_attention_backend(model, None)
    graph_static = 0
    if shape.graph_max_bs:
        before = meter.allocated()
        backend.init_capture(shape.graph_max_bs)
        ladder = batch_size_ladder(shape.graph_max_bs)
        for bs in ladder:
            backend.prepare_for_capture(bs)
        # each batch size's plain graph keeps its logits (the largest: in the pool); its
        # shared-prefix variants write into them, but a variant's own logits are a temporary
        # of the pool while it is captured, beside the plain graph's: one more [bs, vocab]
        # block the pool keeps (freed, reused by the next captures), the largest batch's
        rows = sum(ladder[:-1])
        if backend.supports_shared_prefixes and ladder[-1] >= SHARED_MIN_BS:
            rows += ladder[-1]
        logits_bytes = dtype.itemsize * vocab_size * rows  # the model's dtype
        graph_static = meter.allocated() - before + logits_bytes
    del run, backend, storage, req_pool
    return ActivationProfile(prefill_bytes=prefill, decode_bytes=decode,
                             graph_pool_bytes=graph_pool, graph_static_bytes=graph_static,
                             fixed_bytes=fixed, seconds=time.perf_counter() - start)


class _PassRunner:
    """Builds and runs the profile's passes over the temporary pools."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend,
                 req_pool: ReqToTokenPool, sampler: Sampler, vocab_size: int) -> None:
        self.model = model
        self.backend = backend
        self.req_pool = req_pool
        self.sampler = sampler
        self.vocab_size = vocab_size
        self.device = req_pool.req_to_token.device

    def passes(self, shape: ProfileShape, meter: MemoryMeter) -> tuple[int, int, int]:
        """The profile's passes and their peaks: EXTEND of the largest chunk and DECODE at
        `max_running_requests` (both sampling), DECODE at the graphs' largest batch (forward
        and logits)."""
        prefill = self.extend(shape.prefill_tokens,
                              min(shape.max_running_requests, shape.prefill_tokens), meter)
        decode = self.decode(shape.max_running_requests, meter, sample=True)
        graph_pool = (self.decode(shape.graph_max_bs, meter, sample=False)
                      if shape.graph_max_bs else 0)
        return prefill, decode, graph_pool

    def extend(self, tokens: int, requests: int, meter: MemoryMeter) -> int:
        """One EXTEND pass of `tokens` new tokens (at most a full context per request) over
        `requests` requests, every one sampling: the first ones as long as the context allows,
        the last ones one token each."""
        context = self.req_pool.max_context_len - 1
        extend_lens = []
        remaining = min(tokens, requests * context)
        for i in range(requests):
            extend_lens.append(min(context, remaining - (requests - 1 - i)))
            remaining -= extend_lens[-1]
        tokens = sum(extend_lens)
        out = torch.arange(1, tokens + 1, dtype=torch.int64, device=self.device)
        table = self.req_pool.req_to_token
        offset = 0
        for i, n in enumerate(extend_lens):
            table[i, :n] = out[offset:offset + n]
            offset += n
        return self._run(ForwardMode.EXTEND, [0] * requests, extend_lens, out, meter,
                         sample=True)

    def decode(self, rows: int, meter: MemoryMeter, *, sample: bool) -> int:
        """One DECODE pass of `rows` requests with one cached token each."""
        slots = torch.arange(1, 2 * rows + 1, dtype=torch.int64, device=self.device)
        self.req_pool.req_to_token[:rows, :2] = slots.view(rows, 2)
        return self._run(ForwardMode.DECODE, [1] * rows, [1] * rows, slots.view(rows, 2)[:, 1],
                         meter, sample=sample)

    def _run(self, mode: ForwardMode, prefix_lens: list[int], extend_lens: list[int],
             out_cache_loc: torch.Tensor, meter: MemoryMeter, *, sample: bool) -> int:
        n = len(extend_lens)
        total = sum(extend_lens)
        input_ids = [(31 * i + 11) % self.vocab_size for i in range(total)]
        meter.start()
        fb = ForwardBatch.build(
            mode=mode, input_ids=input_ids, req_pool_indices=list(range(n)),
            prefix_lens=prefix_lens, extend_lens=extend_lens,
            out_cache_loc=out_cache_loc.contiguous(), req_to_token=self.req_pool.req_to_token)
        self.backend.init_forward_metadata(fb)
        hidden = self.model(fb.input_ids, fb.positions, fb)
        last_rows = torch.cumsum(fb.extend_lens, 0) - 1
        logits = self.model.compute_logits(hidden[last_rows])
        if sample:
            rows = _heavy_rows(n, self.vocab_size)
            info = self.sampler.batch_info(rows, self.device)  # type: ignore[arg-type]
            self.sampler(logits, info).token_ids()
        del fb, hidden, logits
        return meter.peak()
