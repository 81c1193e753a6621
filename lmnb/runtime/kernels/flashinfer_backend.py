"""FlashInfer attention over the token-level pool: page size 1, so the pool's [slots, kv_heads,
head_dim] buffers are FlashInfer's NHD paged cache as they are ([pages, 1, kv_heads, head_dim])
and `kv_indices` are its page indices.

    EXTEND  BatchPrefillWithPagedKVCacheWrapper, causal (query i of a request sees its prefix and
            its own tokens up to i; the new tokens' K/V are written to the pool first)
    DECODE  BatchDecodeWithPagedKVCacheWrapper; one CUDA-graph wrapper per captured batch size,
            with fixed indptr / indices / last-page-length buffers that `plan` refills per step

An FP8 pool (`kv_cache_dtype="fp8_e4m3"`) is read as FlashInfer reads FP8 KV: one K and one V
scale per layer (`KVStorage(fp8_scales="tensor")`: `fp8_kv_scales`), passed to `run` as floats
(k_scale folds into the softmax scale, v_scale multiplies the output); q stays 16-bit.

`plan` runs on the host from host copies of the indptrs (pinned, so no stream sync) and the
device `kv_indices`; `flashinfer` is imported when the backend is built (1 s; kernels JIT-compile
on first use and are cached under FLASHINFER_WORKSPACE_BASE).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lmnb.runtime.core import ForwardMode
from lmnb.runtime.forward_batch import ForwardBatch
from lmnb.runtime.kernels.base import AttentionBackend
from lmnb.runtime.kernels.registry import register_attention_backend
from lmnb.runtime.memory import KVStorage, ReqToTokenPool

if TYPE_CHECKING:
    from flashinfer import BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper

WORKSPACE_BYTES = 256 << 20
_Q_DTYPES = (torch.float16, torch.bfloat16)
_KV_DTYPES = (*_Q_DTYPES, torch.float8_e4m3fn)


def _host_int32(values: list[int], pinned: bool) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, pin_memory=pinned)


def _indptr(lens: list[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


@register_attention_backend("flashinfer")
class FlashInferAttention(AttentionBackend):
    supports_capture = True
    fp8_kv_scales = "tensor"  # `run` takes one k_scale / v_scale

    @classmethod
    def unsupported(cls, *, dtype: torch.dtype, head_dim: int) -> str | None:
        if dtype not in _KV_DTYPES:
            return f"its kernels take fp16/bf16/fp8_e4m3 KV, not {dtype}"
        if head_dim not in (64, 128, 256):
            return f"head_dim {head_dim} is not one of 64, 128, 256"
        return None

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_dim: int,
                 req_to_token_pool: ReqToTokenPool, kv_storage: KVStorage) -> None:
        super().__init__(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         req_to_token_pool=req_to_token_pool, kv_storage=kv_storage)
        try:
            import flashinfer
        except ImportError as error:
            raise ImportError("attention_backend='flashinfer' needs the flashinfer package "
                              "(flashinfer-python)") from error
        storage = self.kv_storage
        reason = self.unsupported(dtype=storage.dtype, head_dim=self.head_dim)
        if reason:
            raise ValueError(f"FlashInfer attention: {reason}")
        if storage.is_fp8 and storage.fp8_scales != "tensor":
            raise ValueError("FlashInfer attention: it reads an FP8 KV pool with one scale per "
                             "tensor (KVStorage(fp8_scales='tensor')), not per token")
        self._flashinfer = flashinfer
        self.device = storage.device
        self._q_dtype = storage.compute_dtype
        if self._q_dtype not in _Q_DTYPES:
            raise ValueError(f"FlashInfer attention: queries must be fp16/bf16, not "
                             f"{self._q_dtype}")
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._decode = self._decode_wrapper()
        self._graph_decode: dict[int, BatchDecodeWithPagedKVCacheWrapper] = {}
        self._active: (BatchDecodeWithPagedKVCacheWrapper | BatchPrefillWithPagedKVCacheWrapper
                       | None) = None
        self._max_bs = 0
        self._graph_kv_capacity = 0

    def _decode_wrapper(self, **graph: Any) -> BatchDecodeWithPagedKVCacheWrapper:
        # Tensor cores pay off when several query heads share a KV head.
        tensor_cores = self.num_heads // self.num_kv_heads >= 4
        return self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_tensor_cores=tensor_cores, **graph)

    def _plan_decode(self, wrapper: BatchDecodeWithPagedKVCacheWrapper, kv_lens: list[int],
                     kv_indices: torch.Tensor) -> None:
        pinned = self.device.type == "cuda"
        wrapper.plan(_host_int32(_indptr(kv_lens), pinned), kv_indices.to(torch.int32),
                     _host_int32([1] * len(kv_lens), pinned), self.num_heads, self.num_kv_heads,
                     self.head_dim, 1, q_data_type=self._q_dtype,
                     kv_data_type=self.kv_storage.dtype, sm_scale=self.scale)

    # ---- eager ---------------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        if forward_batch.mode is ForwardMode.DECODE:
            self._plan_decode(self._decode, forward_batch.seq_lens_cpu, forward_batch.kv_indices)
            self._active = self._decode
            return
        pinned = self.device.type == "cuda"
        lens = forward_batch.seq_lens_cpu
        self._prefill.plan(
            _host_int32(_indptr(forward_batch.extend_lens_cpu), pinned),
            _host_int32(_indptr(lens), pinned), forward_batch.kv_indices.to(torch.int32),
            _host_int32([1] * len(lens), pinned), self.num_heads, self.num_kv_heads,
            self.head_dim, 1, causal=True, q_data_type=self._q_dtype,
            kv_data_type=self.kv_storage.dtype, sm_scale=self.scale)
        self._active = self._prefill

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                layer_id: int, forward_batch: ForwardBatch, *, save_kv: bool = True
                ) -> torch.Tensor:
        query, k_buffer, v_buffer = self.prepare_layer(q, k, v, layer_id, forward_batch,
                                                       save_kv=save_kv)
        cache = (k_buffer.unsqueeze(1),  # [pages, page_size 1, kv_heads, dim]
                 v_buffer.unsqueeze(1))
        k_scale, v_scale = (self.kv_storage.tensor_scales[layer_id]
                            if self.kv_storage.is_fp8 else (None, None))
        out = self._active.run(query.to(self._q_dtype), cache, k_scale=k_scale, v_scale=v_scale)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim).to(q.dtype)

    # ---- CUDA graphs ---------------------------------------------------------------------------
    def init_capture(self, max_bs: int) -> None:
        self._max_bs = max_bs
        self._graph_kv_capacity = max_bs * self.req_to_token_pool.max_context_len

    def _graph_wrapper(self, bs: int) -> BatchDecodeWithPagedKVCacheWrapper:
        wrapper = self._graph_decode.get(bs)
        if wrapper is None:
            wrapper = self._graph_decode[bs] = self._decode_wrapper(
                use_cuda_graph=True,
                paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32,
                                                   device=self.device),
                paged_kv_indices_buffer=torch.zeros(self._graph_kv_capacity + bs,
                                                    dtype=torch.int32, device=self.device),
                paged_kv_last_page_len_buffer=torch.ones(bs, dtype=torch.int32,
                                                         device=self.device))
        return wrapper

    def prepare_for_capture(self, bs: int, *, prefix_rows: int = 0) -> None:
        wrapper = self._graph_wrapper(bs)
        dummy = torch.zeros(bs, dtype=torch.int64, device=self.device)  # each row: slot 0
        self._plan_decode(wrapper, [1] * bs, dummy)
        self._active = wrapper

    def can_replay(self, forward_batch: ForwardBatch) -> bool:
        return (forward_batch.batch_size <= self._max_bs
                and forward_batch.num_kv_tokens <= self._graph_kv_capacity)

    def prepare_for_replay(self, forward_batch: ForwardBatch, bs: int | None = None, *,
                           prefix_rows: int = 0) -> None:
        n = forward_batch.batch_size
        bs = n if bs is None else bs
        wrapper = self._graph_wrapper(bs)
        indices = forward_batch.kv_indices
        if bs > n:  # padded rows: one KV token each, the padding slot 0
            indices = torch.cat((indices, torch.zeros(bs - n, dtype=indices.dtype,
                                                      device=indices.device)))
        self._plan_decode(wrapper, forward_batch.seq_lens_cpu + [1] * (bs - n), indices)
        self._active = wrapper
