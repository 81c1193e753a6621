"""The interface every attention backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, NamedTuple

import torch

from lmnb.runtime.forward_batch import ForwardBatch
from lmnb.runtime.memory import KVStorage, ReqToTokenPool
from lmnb.runtime.memory.kv_storage import Fp8Scales


class BackendChoice(NamedTuple):
    name: str
    reason: str  # why this backend, e.g. why "auto" passed over the faster ones


class LayerAttentionInputs(NamedTuple):
    """What every backend's `forward` attends with, after the new K/V are in the pool."""

    q: torch.Tensor  # [num_tokens, heads, head_dim], a view of forward's q
    k_buffer: torch.Tensor  # [slots, kv_heads, head_dim], the layer's pool buffers
    v_buffer: torch.Tensor


class AttentionBackend(ABC):
    """Attention over the token-level KV pool (page size 1).

    Per pass, eager:
        init_forward_metadata(fb)   once, before the first layer: derive whatever the kernels need
                                    from fb.qo_indptr / kv_indptr / kv_indices (built on the device
                                    by `ForwardBatch.build`); no host sync in DECODE
        forward(q, k, v, layer, fb) every layer: write the new tokens' K/V to fb.out_cache_loc
                                    (unless save_kv=False: the caller wrote them), then attend
                                    each query to its request's KV causally

    CUDA-graph capture and replay, DECODE only (`supports_capture` backends):
        init_capture(max_bs)        once: allocate static metadata buffers for up to max_bs rows,
                                    filled with a valid dummy decode (seq_len 1 reading slot 0)
        prepare_for_capture(bs)     before capturing the graph of size bs: point forward at the
                                    static buffers' first bs rows
        can_replay(fb)              whether this step's batch fits the static buffers (else eager)
        prepare_for_replay(fb, bs)  before each replay of the graph of size bs >= fb.batch_size:
                                    copy this step's metadata into the static buffers (rows
                                    fb.batch_size..bs become dummies) and point forward at them

    Invariants of the capture path:
    - `forward` in DECODE after prepare_for_capture/prepare_for_replay reads only static buffers,
      the KV pool, and of the ForwardBatch only `mode` and `out_cache_loc` (which the graph runner
      keeps static): no tensor it touches is reallocated, no shape depends on this step, no host
      value is read back, so the recorded kernels stay valid for every replay.
    - Padded rows (fb.batch_size <= row < bs) attend only to slot 0, the pool's padding slot; their
      outputs are garbage the caller drops, and their K/V writes (out_cache_loc padded with 0)
      land in slot 0 and hurt nobody.
    - A replay gives the same result as eager decode of the same batch (tests check it).
    `kernels.metadata.DecodeBuffers` holds static seq_lens / kv_indptr / kv_indices padded this way;
    a backend keeps whatever it derives from them (padded slot tables, wrapper plans) static too.
    """

    supports_capture: ClassVar[bool] = False
    # DECODE reads a group's shared prefix once (`ForwardBatch.shared_prefixes`); others ignore it
    supports_shared_prefixes: ClassVar[bool] = False
    # the variants of such decode a graph is captured in (tile heights, `prefix_rows`)
    prefix_variants: ClassVar[tuple[int, ...]] = ()
    # the scales of an FP8 KV pool this backend reads (`KVStorage(fp8_scales=)`): "token" pools
    # (per token and KV head, the quality pick) or "tensor" ones (FlashInfer's one per tensor)
    fp8_kv_scales: ClassVar[Fp8Scales] = "token"
    choice: BackendChoice | None = None  # set by `create_attention_backend`: name and why

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_dim: int,
                 req_to_token_pool: ReqToTokenPool, kv_storage: KVStorage) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.req_to_token_pool = req_to_token_pool
        self.kv_storage = kv_storage

    @classmethod
    def unsupported(cls, *, dtype: torch.dtype, head_dim: int) -> str | None:
        """Why this backend cannot serve KV of `dtype` and `head_dim` (None: it can); "auto"
        passes over a backend that says why."""
        return None

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:  # noqa: B027
        """Precompute per-step data shared by all layers (called once per eager forward pass)."""

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                 forward_batch: ForwardBatch) -> None:
        """Writes the new tokens' K/V ([num_tokens, kv_heads * head_dim]) to their slots."""
        shape = (k.shape[0], self.num_kv_heads, self.head_dim)
        self.kv_storage.set_kv(layer_id, forward_batch.out_cache_loc, k.view(shape),
                               v.view(shape))

    def prepare_layer(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                      layer_id: int, forward_batch: ForwardBatch, *, save_kv: bool = True
                      ) -> LayerAttentionInputs:
        """The common start of `forward`: store the new K/V (unless save_kv=False), look up the
        layer's KV buffers and view q per head."""
        if save_kv:
            self.store_kv(k, v, layer_id, forward_batch)
        storage = self.kv_storage
        storage.ready(layer_id)  # rows a hierarchical cache is still loading (other rows)
        return LayerAttentionInputs(q.view(q.shape[0], self.num_heads, self.head_dim),
                                    storage.k_buffers[layer_id], storage.v_buffers[layer_id])

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                layer_id: int, forward_batch: ForwardBatch, *, save_kv: bool = True
                ) -> torch.Tensor:
        """q [num_tokens, heads * head_dim], k/v [num_tokens, kv_heads * head_dim] -> like q.

        save_kv=False: the caller has written this pass's K/V to fb.out_cache_loc already (the
        fused rotary kernel does); k and v are then unused (None)."""

    def init_capture(self, max_bs: int) -> None:
        """Allocate the static decode metadata for graphs of up to `max_bs` requests."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA-graph capture")

    def prepare_for_capture(self, bs: int, *, prefix_rows: int = 0) -> None:
        """Make DECODE `forward` read the static buffers of a padded batch of `bs` requests
        (`prefix_rows`, one of `prefix_variants`: the variant that reads groups' shared
        prefixes once per tile of that many query rows; 0: none)."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA-graph capture")

    def prefix_rows(self, forward_batch: ForwardBatch) -> int:
        """The variant (one of `prefix_variants`, 0: plain) that reads this DECODE batch's
        `shared_prefixes`."""
        return 0

    def can_replay(self, forward_batch: ForwardBatch) -> bool:
        """Whether the static buffers of `init_capture` hold this DECODE batch (else: eager)."""
        return False

    def prepare_for_replay(self, forward_batch: ForwardBatch, bs: int | None = None, *,
                           prefix_rows: int = 0) -> None:
        """Copy a DECODE batch's metadata into the static buffers of the graph of size `bs`
        (`prefix_rows`: of that shared-prefix variant, `forward_batch.shared_prefixes`
        included)."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA-graph capture")
