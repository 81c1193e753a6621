"""Neox-style rotary embedding with a precomputed cos/sin table over all positions."""

from __future__ import annotations

import math

import torch

from lmnb.runtime.config import ModelConfig
from lmnb.runtime.models.layers.fusion import Fusable


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    head_dim = config.head_dim
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    params = config.rope_scaling
    if params is None:
        return inv_freq
    rope_type = params["rope_type"]
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        factor = params["factor"]
        low_freq_factor, high_freq_factor = params["low_freq_factor"], params["high_freq_factor"]
        old_context_len = params["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = ((old_context_len / wavelen - low_freq_factor)
                  / (high_freq_factor - low_freq_factor))
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"rope type {rope_type!r} is not supported (default, linear, llama3)")


class RotaryEmbedding(Fusable):
    """cos/sin [max_positions, head_dim] float32 (neox: the two halves of a row are equal).

    `forward(positions, q, k)` rotates q/k heads with torch ops; `rotate_qkv` starts from the
    qkv projection and, fused, is one kernel that can also store k and v in the KV pool."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq = rope_inverse_frequencies(config)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self.head_dim = config.head_dim

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q [num_tokens, heads, dim], k [num_tokens, kv_heads, dim]
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return (q * cos + self._rotate_half(q) * sin,
                k * cos + self._rotate_half(k) * sin)

    def rotate_qkv(self, positions: torch.Tensor, qkv: torch.Tensor, *, num_heads: int,
                   num_kv_heads: int,
                   kv_buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
                   slots: torch.Tensor | None = None,
                   kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """qkv [tokens, (heads + 2 kv_heads) * head_dim] -> (q, k, v) as [tokens, n * head_dim],
        q and k rotated. Fused with `kv_buffers` (a layer's K and V buffers) and `slots`, k and v
        go straight to those slots and come back as None (an FP8 pool's with `kv_scales`, the
        layer's per-slot scales)."""
        dim = self.head_dim
        if self.fused:
            from lmnb.runtime.kernels.fused import rotary_qkv

            q, k = rotary_qkv(positions, qkv, self.cos, self.sin, num_heads=num_heads,
                              num_kv_heads=num_kv_heads, head_dim=dim, kv_buffers=kv_buffers,
                              slots=slots, kv_scales=kv_scales)
            if kv_buffers is not None:
                return q, None, None
            return q, k, qkv[:, (num_heads + num_kv_heads) * dim:]
        tokens = qkv.shape[0]
        q, k, v = qkv.split((num_heads * dim, num_kv_heads * dim, num_kv_heads * dim), dim=-1)
        q, k = self(positions, q.view(tokens, num_heads, dim), k.view(tokens, num_kv_heads, dim))
        return q.reshape(tokens, -1), k.reshape(tokens, -1), v
