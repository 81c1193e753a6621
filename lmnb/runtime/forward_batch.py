"""Per-step tensors handed from the model runner to every attention layer.

Only what changes every pass lives here; the long-lived side (the attention backend and the KV
storage and request-to-token table it owns) is bound to the model's attention layers once
(`models/layers/attention.py`)."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch

from lmnb.runtime.core import ForwardMode
from lmnb.runtime.kernels.metadata import (
    build_indptr,
    build_kv_indices,
    build_positions,
    host_int64,
)


@dataclass
class ForwardBatch:
    """The flattened tokens of one forward pass and where their KV lives.

    Tokens of all requests are concatenated, request by request: request i contributes
    `extend_lens[i]` tokens at positions `prefix_lens[i] ...` (one token in DECODE), and after the
    pass its KV is `seq_lens[i] = prefix_lens[i] + extend_lens[i]` tokens, the slots
    `kv_indices[kv_indptr[i] : kv_indptr[i + 1]]` (see `kernels/metadata.py`). Device tensors and
    their host twins (`*_cpu`, used only for sizes and host-side loops) hold the same values.
    """

    mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    out_cache_loc: torch.Tensor  # [num_tokens] KV slots the new tokens are written to
    req_pool_indices: torch.Tensor  # [bs]
    prefix_lens: torch.Tensor  # [bs] KV already cached before this pass
    extend_lens: torch.Tensor  # [bs] new tokens of this pass
    seq_lens: torch.Tensor  # [bs] KV length after this pass
    qo_indptr: torch.Tensor  # [bs + 1]
    kv_indptr: torch.Tensor  # [bs + 1]
    kv_indices: torch.Tensor  # [num_kv_tokens]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    num_kv_tokens: int
    # DECODE: (length, rows) groups sharing a cached prefix (`Batch.shared_prefixes`)
    shared_prefixes: list[tuple[int, list[int]]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @classmethod
    def build(cls, *, mode: ForwardMode, input_ids: list[int] | torch.Tensor,
              req_pool_indices: list[int],
              prefix_lens: list[int], extend_lens: list[int], out_cache_loc: torch.Tensor,
              req_to_token: torch.Tensor, kv_indices: torch.Tensor | None = None,
              shared_prefixes: list[tuple[int, list[int]]] | None = None) -> ForwardBatch:
        """All device tensors from host lists with one host-to-device copy; no sync.

        `input_ids` may already be a tensor (then it is moved, not packed with the lengths);
        `kv_indices` given (a tensor-parallel worker gets rank 0's) skips reading `req_to_token`.
        """
        device = req_to_token.device
        bs = len(req_pool_indices)
        if len(prefix_lens) != bs or len(extend_lens) != bs:
            raise ValueError(f"{bs} requests but {len(prefix_lens)} prefix_lens and "
                             f"{len(extend_lens)} extend_lens")
        seq_lens_cpu = list(map(operator.add, prefix_lens, extend_lens))
        ids_given = isinstance(input_ids, torch.Tensor)
        host = host_int64([*req_pool_indices, *prefix_lens, *extend_lens,
                           *(() if ids_given else input_ids)], pin=device.type == "cuda")
        packed = host.to(device, non_blocking=True)
        ids = (input_ids.to(device=device, dtype=torch.int64, non_blocking=True) if ids_given
               else packed[3 * bs:])
        num_tokens = ids.numel()
        pool_indices, prefix, extend = packed[:bs], packed[bs:2 * bs], packed[2 * bs:3 * bs]
        seq_lens = prefix + extend
        num_kv_tokens = sum(seq_lens_cpu)
        if mode is ForwardMode.DECODE:
            qo_indptr = torch.arange(bs + 1, dtype=torch.int64, device=device)
            positions = prefix
        else:
            qo_indptr = build_indptr(extend)
            positions = build_positions(prefix, extend, qo_indptr, num_tokens)
        kv_indptr = build_indptr(seq_lens)
        return cls(
            mode=mode, batch_size=bs, input_ids=ids, positions=positions,
            out_cache_loc=out_cache_loc, req_pool_indices=pool_indices, prefix_lens=prefix,
            extend_lens=extend, seq_lens=seq_lens, qo_indptr=qo_indptr, kv_indptr=kv_indptr,
            kv_indices=kv_indices if kv_indices is not None else build_kv_indices(
                req_to_token, pool_indices, seq_lens, kv_indptr, num_kv_tokens),
            prefix_lens_cpu=list(prefix_lens), extend_lens_cpu=list(extend_lens),
            seq_lens_cpu=seq_lens_cpu, num_kv_tokens=num_kv_tokens,
            shared_prefixes=shared_prefixes or [])
