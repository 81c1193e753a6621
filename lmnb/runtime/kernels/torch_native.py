"""Attention in plain torch (SDPA): the CPU path and the reference for GPU kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmnb.runtime.core import ForwardMode
from lmnb.runtime.forward_batch import ForwardBatch
from lmnb.runtime.kernels.base import AttentionBackend
from lmnb.runtime.kernels.registry import register_attention_backend


@register_attention_backend("torch_native")
class TorchNativeAttention(AttentionBackend):
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        req_to_token = self.req_to_token_pool.req_to_token
        if forward_batch.mode is ForwardMode.DECODE:
            max_len = max(forward_batch.seq_lens_cpu)
            positions = torch.arange(max_len, device=req_to_token.device)
            valid = positions[None, :] < forward_batch.seq_lens[:, None]  # [bs, max_len]
            # Padding reads slot 0 (always finite): a masked weight times a NaN would still be NaN.
            slots = req_to_token[forward_batch.req_pool_indices, :max_len]
            self._slots = torch.where(valid, slots, torch.zeros_like(slots))
            self._mask = valid[:, None, None, :]
        else:
            self._slots_per_req = [
                req_to_token[int(idx), :seq_len]
                for idx, seq_len in zip(forward_batch.req_pool_indices.tolist(),
                                        forward_batch.seq_lens_cpu, strict=True)
            ]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                forward_batch: ForwardBatch) -> torch.Tensor:
        pool = self.kv_storage
        num_tokens = q.shape[0]
        pool.set_kv(layer_id, forward_batch.out_cache_loc,
                    k.view(num_tokens, self.num_kv_heads, self.head_dim),
                    v.view(num_tokens, self.num_kv_heads, self.head_dim))
        k_buffer, v_buffer = pool.k_buffers[layer_id], pool.v_buffers[layer_id]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        if forward_batch.mode is ForwardMode.DECODE:
            out = self._decode(q, k_buffer, v_buffer)
        else:
            out = self._extend(q, k_buffer, v_buffer, forward_batch)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)

    def _decode(self, q: torch.Tensor, k_buffer: torch.Tensor,
                v_buffer: torch.Tensor) -> torch.Tensor:
        keys = k_buffer[self._slots].transpose(1, 2)  # [bs, kv_heads, max_len, dim]
        values = v_buffer[self._slots].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2).to(keys.dtype), keys, values, attn_mask=self._mask, scale=self.scale,
            enable_gqa=True)  # [bs, heads, 1, dim]
        return out.squeeze(2).to(q.dtype)

    def _extend(self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                forward_batch: ForwardBatch) -> torch.Tensor:
        out = torch.empty_like(q)
        start = 0
        for slots, prefix_len, extend_len in zip(self._slots_per_req,
                                                 forward_batch.extend_prefix_lens,
                                                 forward_batch.extend_seq_lens, strict=True):
            end = start + extend_len
            keys = k_buffer[slots].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, seq, dim]
            values = v_buffer[slots].transpose(0, 1).unsqueeze(0)
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
