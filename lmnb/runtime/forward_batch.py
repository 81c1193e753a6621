"""Per-step metadata handed from the model runner to every attention layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lmnb.runtime.core import ForwardMode

if TYPE_CHECKING:
    from lmnb.runtime.memory import KVStorage, ReqToTokenPool


@dataclass
class ForwardBatch:
    """The flattened tokens of one forward pass and where their KV lives.

    Tokens of all requests are concatenated, request by request: for EXTEND request i contributes
    `extend_seq_lens[i]` tokens at positions `extend_prefix_lens[i] ...`, for DECODE one token.
    """

    mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    out_cache_loc: torch.Tensor  # [num_tokens] KV slots the new tokens are written to
    req_pool_indices: torch.Tensor  # [bs]
    seq_lens: torch.Tensor  # [bs] KV length of each request after this pass
    seq_lens_cpu: list[int]
    extend_prefix_lens: list[int] = field(default_factory=list)  # EXTEND only
    extend_seq_lens: list[int] = field(default_factory=list)  # EXTEND only
    req_to_token_pool: ReqToTokenPool | None = None
    kv_storage: KVStorage | None = None
    attn_backend: Any = None
