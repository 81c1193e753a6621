"""Attention through the Triton kernels: ragged extend and split-K decode over the KV pool.

Every pass writes the new tokens' K/V into the pool first (`KVStorage.set_kv`), then attends:
EXTEND with `triton_extend.extend_attention` (new K/V read back from the pool), DECODE with
`triton_decode.decode_attention`. Decode uses `max_kv_splits` splits per request at most, a
launch constant, so a captured graph stays valid for every context length. Under
TRITON_INTERPRET=1 the same kernels run on CPU tensors.
"""

from __future__ import annotations

import torch

from lmnb.runtime.core import ForwardMode
from lmnb.runtime.forward_batch import ForwardBatch
from lmnb.runtime.kernels.base import AttentionBackend
from lmnb.runtime.kernels.metadata import DecodeBuffers, device_tensor, host_int64
from lmnb.runtime.kernels.registry import register_attention_backend
from lmnb.runtime.kernels.shared_prefix import (
    GRAPH_ITEMS,
    ITEM_HEAD,
    PREFIX_SPLITS,
    TILE_HEIGHTS,
    PrefixPlan,
    SharedPrefixes,
    members_per_tile,
    plan_items,
    tile_heights,
    tile_rows_for,
)
from lmnb.runtime.kernels.triton_decode import decode_attention, partial_buffers
from lmnb.runtime.kernels.triton_extend import ExtendConfig, extend_attention, extend_config
from lmnb.runtime.memory import KVStorage, ReqToTokenPool

DEFAULT_MAX_KV_SPLITS = 16
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn)


def kernel_index_dtype(buffer_elements: int) -> torch.dtype:
    """The dtype of the index metadata (indptrs, slots, prefix items) the kernels read over a
    pool whose layer K/V buffers hold `buffer_elements` elements: int32 while every element
    offset fits in it, so that the kernels' address and mask arithmetic is 32-bit (H200,
    Llama-3-8B: the shared-prefix run's extend passes 1.6-1.7x faster, shared-prefix decode
    1.16x, than with int64 metadata); else int64."""
    return torch.int32 if buffer_elements < 2**31 else torch.int64


@register_attention_backend("triton")
class TritonAttention(AttentionBackend):
    supports_capture = True
    supports_shared_prefixes = True

    # DECODE: what `forward` reads; eager tensors of this step or views of the static buffers.
    _kv_indptr: torch.Tensor  # [bs + 1]
    _kv_indices: torch.Tensor  # [>= num_kv_tokens]
    _partial_out: torch.Tensor  # [bs, heads, splits, head_dim] float32 scratch
    _partial_lse: torch.Tensor  # [bs, heads, splits]
    _shared: SharedPrefixes | None  # prefix groups read once per tile (shared_prefix.py)
    # EXTEND: the batch's metadata in the kernels' index dtype
    _max_extend_len: int
    _extend_config: ExtendConfig  # tiles by the batch's rows
    _qo_indptr: torch.Tensor  # [bs + 1]
    _extend_kv_indptr: torch.Tensor  # [bs + 1]
    _extend_kv_indices: torch.Tensor  # [num_kv_tokens]

    @classmethod
    def unsupported(cls, *, dtype: torch.dtype, head_dim: int) -> str | None:
        if dtype not in _DTYPES:
            return f"its kernels take fp16/bf16/fp32/fp8_e4m3 KV, not {dtype}"
        return None  # any head_dim: tiles are padded to a power of two

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_dim: int,
                 req_to_token_pool: ReqToTokenPool, kv_storage: KVStorage,
                 max_kv_splits: int = DEFAULT_MAX_KV_SPLITS) -> None:
        super().__init__(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         req_to_token_pool=req_to_token_pool, kv_storage=kv_storage)
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} heads do not group over {num_kv_heads} KV heads")
        reason = self.unsupported(dtype=kv_storage.dtype, head_dim=head_dim)
        if reason:
            raise ValueError(f"Triton attention: {reason}")
        self.max_kv_splits = max_kv_splits
        self._device = req_to_token_pool.req_to_token.device
        self._index_dtype = kernel_index_dtype(
            (kv_storage.size + 1) * kv_storage.kv_heads * kv_storage.head_dim)
        self._shared = None
        self.prefix_variants = tile_heights(num_heads, num_kv_heads)
        if kv_storage.is_fp8 or not self.prefix_variants:  # the kernel reads 16/32-bit KV only
            self.supports_shared_prefixes = False

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        if forward_batch.mode is ForwardMode.DECODE:
            self._kv_indptr, self._kv_indices = (
                t.to(self._index_dtype) for t in (forward_batch.kv_indptr,
                                                  forward_batch.kv_indices))
            self._shared = None
            if forward_batch.shared_prefixes:
                members, plan = self._plan(forward_batch, forward_batch.batch_size,
                                           self.prefix_rows(forward_batch))
                if plan.items:
                    num_items = len(plan.items)
                    self._shared = SharedPrefixes.view(
                        device_tensor(plan.flat(num_items, members), self._index_dtype,
                                      self._device),
                        batch_size=forward_batch.batch_size, num_items=num_items,
                        members=members)
            splits = self.max_kv_splits + (PREFIX_SPLITS if self._shared else 0)
            self._partial_out, self._partial_lse = partial_buffers(
                forward_batch.batch_size, self.num_heads, self.head_dim, splits, self._device)
        else:
            self._max_extend_len = max(forward_batch.extend_lens_cpu, default=1)
            group = self.num_heads // self.num_kv_heads
            self._extend_config = extend_config(
                self.head_dim, self.kv_storage.dtype, group=group,
                rows=[n * group for n in forward_batch.extend_lens_cpu])
            self._qo_indptr, self._extend_kv_indptr, self._extend_kv_indices = (
                t.to(self._index_dtype) for t in (forward_batch.qo_indptr,
                                                  forward_batch.kv_indptr,
                                                  forward_batch.kv_indices))

    def init_capture(self, max_bs: int, *, kv_capacity: int | None = None) -> None:
        """Static buffers for graphs of up to `max_bs` rows holding up to `kv_capacity` KV tokens
        in all (default: `max_bs` full-width requests)."""
        width = self.req_to_token_pool.req_to_token.shape[1]
        self._buffers = DecodeBuffers(max_bs, kv_capacity or max_bs * width, self._device,
                                      index_dtype=self._index_dtype)
        self._static_partials = partial_buffers(max_bs, self.num_heads, self.head_dim,
                                                self.max_kv_splits + PREFIX_SPLITS, self._device)
        # kv_skip, prefix_parts, items: one buffer, filled by one copy a replay
        width = ITEM_HEAD + self._members(max(TILE_HEIGHTS))
        self._static_shared_flat = torch.zeros(2 * max_bs + GRAPH_ITEMS * width,
                                               dtype=self._index_dtype, device=self._device)

    def can_replay(self, forward_batch: ForwardBatch) -> bool:
        return self._buffers.fits(forward_batch.batch_size, forward_batch.num_kv_tokens)

    def prefix_rows(self, forward_batch: ForwardBatch) -> int:
        if not forward_batch.shared_prefixes:
            return 0
        return tile_rows_for(forward_batch.shared_prefixes, self.num_heads, self.num_kv_heads)

    def _members(self, rows: int) -> int:
        return members_per_tile(self.num_heads, self.num_kv_heads, rows)

    def _plan(self, forward_batch: ForwardBatch, bs: int, rows: int) -> tuple[int, PrefixPlan]:
        """Members a tile of `rows` query rows, and the work items of the batch's groups."""
        members = self._members(rows)
        return members, plan_items(forward_batch.shared_prefixes, batch_size=bs,
                                   members=members, max_items=GRAPH_ITEMS)

    def prepare_for_capture(self, bs: int, *, prefix_rows: int = 0) -> None:
        buffers = self._buffers
        self._kv_indptr, self._kv_indices = buffers.kv_indptr[:bs + 1], buffers.kv_indices
        self._partial_out, self._partial_lse = (t[:bs] for t in self._static_partials)
        self._shared = SharedPrefixes.view(self._static_shared_flat, batch_size=bs,
                                           num_items=GRAPH_ITEMS,
                                           members=self._members(prefix_rows)
                                           ) if prefix_rows else None

    def prepare_for_replay(self, forward_batch: ForwardBatch, bs: int | None = None, *,
                           prefix_rows: int = 0) -> None:
        bs = forward_batch.batch_size if bs is None else bs
        self._buffers.fill(seq_lens=forward_batch.seq_lens, kv_indptr=forward_batch.kv_indptr,
                           kv_indices=forward_batch.kv_indices,
                           num_kv_tokens=forward_batch.num_kv_tokens, bs=bs)
        self.prepare_for_capture(bs, prefix_rows=prefix_rows)
        if prefix_rows:  # one copy of the groups' items; padding rows skip nothing, empty items
            members, plan = self._plan(forward_batch, bs, prefix_rows)
            flat = plan.flat(GRAPH_ITEMS, members)
            host = host_int64(flat).to(self._index_dtype)
            self._static_shared_flat[:len(flat)].copy_(
                host.pin_memory() if self._device.type == "cuda" else host, non_blocking=True)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                layer_id: int, forward_batch: ForwardBatch, *, save_kv: bool = True
                ) -> torch.Tensor:
        q, k_buffer, v_buffer = self.prepare_layer(q, k, v, layer_id, forward_batch,
                                                   save_kv=save_kv)
        out = torch.empty_like(q)
        if forward_batch.mode is ForwardMode.DECODE:
            decode_attention(q, k_buffer, v_buffer, out, self._kv_indptr, self._kv_indices,
                             self._partial_out, self._partial_lse, scale=self.scale,
                             max_kv_splits=self.max_kv_splits, shared=self._shared,
                             kv_scales=self.kv_storage.scales(layer_id))
        else:
            extend_attention(q, k_buffer, v_buffer, out, self._qo_indptr,
                             self._extend_kv_indptr, self._extend_kv_indices,
                             max_extend_len=self._max_extend_len, scale=self.scale,
                             config=self._extend_config,
                             kv_scales=self.kv_storage.scales(layer_id))
        return out.view(q.shape[0], self.num_heads * self.head_dim)
