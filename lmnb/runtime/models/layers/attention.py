"""How a model's attention layers reach the attention backend.

Two lifetimes meet in a layer's attention. The backend lives as long as its model runner and owns
the KV storage and the request-to-token table; it is bound once to every `PooledAttention` layer
of a model (`bind_attention_backend`). The `ForwardBatch` lives one pass and is the only thing a
forward is handed, so a layer's attention stays `backend.forward(q, k, v, layer_id, batch)`.

Whoever owns the pools binds: the `ModelRunner` when it builds them (a model serves one runner at a
time: the last bound), a memory profile for its passes over temporary pools (unbound after, so
the model keeps nothing of them alive).

A checkpoint with calibrated FP8 KV scales (compressed-tensors' `kv_cache_scheme`: one K and one
V scale per layer, `self_attn.k_scale` / `v_scale`) leaves them on its layers (`kv_scales`);
`apply_checkpoint_kv_scales` gives them to a pool of fixed scales (`KVStorage(fp8_scales=
"tensor")`, FlashInfer's). A pool of per-token scales (Triton's) computes its own and needs none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from lmnb.runtime.kernels.base import AttentionBackend
    from lmnb.runtime.memory import KVStorage


class PooledAttention(nn.Module):
    """A layer that attends over the KV pool through the bound backend (None: not bound yet)."""

    attn_backend: AttentionBackend | None = None
    layer_id: int = 0  # its layer in the KV pool
    kv_scales: tuple[float, float] | None = None  # the checkpoint's FP8 (k, v) scales, if any


def apply_checkpoint_kv_scales(model: nn.Module, storage: KVStorage) -> int:
    """The checkpoint's FP8 KV scales of `model`'s layers into `storage` where it keeps fixed
    scales (before any row is written); returns how many layers took theirs."""
    if not storage.tensor_scales:
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, PooledAttention) and module.kv_scales is not None:
            storage.set_tensor_scales(module.layer_id, *module.kv_scales)
            count += 1
    return count


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
