"""The interface every attention backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from lmnb.runtime.forward_batch import ForwardBatch
from lmnb.runtime.memory import KVStorage, ReqToTokenPool


class AttentionBackend(ABC):
    """Attention over the token-level KV pool.

    `forward` writes the new tokens' K/V to `forward_batch.out_cache_loc` of layer `layer_id`, then
    attends each query token to its request's whole KV (`req_to_token[req, :seq_len]`), causally
    within the request.
    """

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_dim: int,
                 req_to_token_pool: ReqToTokenPool, kv_storage: KVStorage) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.req_to_token_pool = req_to_token_pool
        self.kv_storage = kv_storage

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:  # noqa: B027
        """Precompute per-step data shared by all layers (called once per forward pass)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                forward_batch: ForwardBatch) -> torch.Tensor:
        """q [num_tokens, heads * head_dim], k/v [num_tokens, kv_heads * head_dim] -> like q."""
