"""Attention in plain torch (SDPA): the CPU path and the reference for GPU kernels.

DECODE gathers each request's KV into a padded [bs, max_kv_len] slot table; eager passes use the
batch's longest sequence as max_kv_len, captured ones the bound fixed by `init_capture` (the whole
`req_to_token` width by default), so the gathered K/V grow with that bound: capture here exists for
correctness tests, the GPU backends are the fast path. EXTEND runs one SDPA per request.
"""

from __future__ import annotations

from itertools import accumulate

import torch
import torch.nn.functional as F

from lmnb.runtime.core import ForwardMode
from lmnb.runtime.forward_batch import ForwardBatch
from lmnb.runtime.kernels.base import AttentionBackend
from lmnb.runtime.kernels.metadata import DecodeBuffers, padded_kv_slots
from lmnb.runtime.kernels.registry import register_attention_backend


@register_attention_backend("torch_native")
class TorchNativeAttention(AttentionBackend):
    supports_capture = True

    _slots: torch.Tensor  # [bs, max_kv_len] KV slots, padding reads slot 0
    _mask: torch.Tensor  # [bs, 1, 1, max_kv_len] true where the slot is the request's

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        if forward_batch.mode is ForwardMode.DECODE:
            slots, valid = padded_kv_slots(forward_batch.kv_indptr, forward_batch.kv_indices,
                                           forward_batch.seq_lens, max(forward_batch.seq_lens_cpu))
            self._slots, self._mask = slots, valid[:, None, None, :]
        else:
            self._kv_starts = [0, *accumulate(forward_batch.seq_lens_cpu)]

    def init_capture(self, max_bs: int, *, max_kv_len: int | None = None) -> None:
        req_to_token = self.req_to_token_pool.req_to_token
        self._max_kv_len = max_kv_len or req_to_token.shape[1]
        self._buffers = DecodeBuffers(max_bs, max_bs * self._max_kv_len, req_to_token.device)
        self._static_slots = torch.zeros((max_bs, self._max_kv_len), dtype=torch.int64,
                                         device=req_to_token.device)
        self._static_valid = torch.zeros((max_bs, self._max_kv_len), dtype=torch.bool,
                                         device=req_to_token.device)
        self._static_valid[:, 0] = True  # dummy rows: one KV token, the padding slot

    def can_replay(self, forward_batch: ForwardBatch) -> bool:
        return (self._buffers.fits(forward_batch.batch_size, forward_batch.num_kv_tokens)
                and max(forward_batch.seq_lens_cpu) <= self._max_kv_len)

    def prepare_for_capture(self, bs: int, *, prefix_rows: int = 0) -> None:
        self._slots = self._static_slots[:bs]
        self._mask = self._static_valid[:bs, None, None, :]

    def prepare_for_replay(self, forward_batch: ForwardBatch, bs: int | None = None, *,
                           prefix_rows: int = 0) -> None:
        bs = forward_batch.batch_size if bs is None else bs
        buffers = self._buffers
        buffers.fill(seq_lens=forward_batch.seq_lens, kv_indptr=forward_batch.kv_indptr,
                     kv_indices=forward_batch.kv_indices,
                     num_kv_tokens=forward_batch.num_kv_tokens, bs=bs)
        slots, valid = padded_kv_slots(buffers.kv_indptr[:bs + 1], buffers.kv_indices,
                                       buffers.seq_lens[:bs], self._max_kv_len)
        self._static_slots[:bs].copy_(slots)
        self._static_valid[:bs].copy_(valid)
        self.prepare_for_capture(bs)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                layer_id: int, forward_batch: ForwardBatch, *, save_kv: bool = True
                ) -> torch.Tensor:
        q, _, _ = self.prepare_layer(q, k, v, layer_id, forward_batch, save_kv=save_kv)
        if forward_batch.mode is ForwardMode.DECODE:
            out = self._decode(q, layer_id)
        else:
            out = self._extend(q, layer_id, forward_batch)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def _decode(self, q: torch.Tensor, layer_id: int) -> torch.Tensor:
        # an FP8 pool's rows come back dequantized, in the model's dtype
        keys, values = self.kv_storage.read(layer_id, self._slots)  # [bs, len, kv_heads, dim]
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [bs, kv_heads, len, dim]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2).to(keys.dtype), keys, values, attn_mask=self._mask, scale=self.scale,
            enable_gqa=True)  # [bs, heads, 1, dim]
        return out.squeeze(2).to(q.dtype)

    def _extend(self, q: torch.Tensor, layer_id: int,
                forward_batch: ForwardBatch) -> torch.Tensor:
        out = torch.empty_like(q)
        kv_indices = forward_batch.kv_indices
        start = 0
        for i, (prefix_len, extend_len) in enumerate(zip(forward_batch.prefix_lens_cpu,
                                                         forward_batch.extend_lens_cpu,
                                                         strict=True)):
            end = start + extend_len
            slots = kv_indices[self._kv_starts[i]:self._kv_starts[i + 1]]
            keys, values = self.kv_storage.read(layer_id, slots)  # [seq, kv_heads, dim]
            keys = keys.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, seq, dim]
            values = values.transpose(0, 1).unsqueeze(0)
            query = q[start:end].transpose(0, 1).unsqueeze(0).to(keys.dtype)
            if prefix_len == 0:
                mask, causal = None, True
            else:
                rows = torch.arange(extend_len, device=q.device)[:, None] + prefix_len
                mask = torch.arange(len(slots), device=q.device)[None, :] <= rows
                causal = False
            attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask,
                                                      is_causal=causal, scale=self.scale,
                                                      enable_gqa=True)
            out[start:end] = attended.squeeze(0).transpose(0, 1).to(q.dtype)
            start = end
        return out
