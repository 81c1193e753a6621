"""How a model's attention layers reach the attention backend.

Two lifetimes meet in a layer's attention. The backend lives as long as its model runner and owns
the KV storage and the request-to-token table; it is bound once to every `PooledAttention` layer
of a model (`bind_attention_backend`). The `ForwardBatch` lives one pass and is the only thing a
forward is handed, so a layer's attention stays `backend.forward(q, k, v, layer_id, batch)`.

Whoever owns the pools binds: the `ModelRunner` when it builds them (a model serves one runner at a
time: the last bound), a memory profile for its passes over temporary pools (unbound after, so
the model keeps nothing of them alive).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from lmnb.runtime.kernels.base import AttentionBackend


class PooledAttention(nn.Module):
    """A layer that attends over the KV pool through the bound backend (None: not bound yet)."""

    attn_backend: AttentionBackend | None = None


def bind_attention_backend(model: nn.Module | None, backend: AttentionBackend | None) -> int:
    """Points every `PooledAttention` layer of `model` at `backend` (None unbinds); returns how
    many layers it bound."""
    if model is None:
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, PooledAttention):
            module.attn_backend = backend
            count += 1
    return count


def bound_to(model: nn.Module, backend: AttentionBackend) -> bool:
    """Whether every `PooledAttention` layer of `model` attends through `backend`."""
    return all(module.attn_backend is backend for module in model.modules()
               if isinstance(module, PooledAttention))
