"""`logit_bias` of a batch: each row's {token id: bias} added to its logits before sampling.

Sparse: one entry per (row, biased token), so rows without a bias cost nothing and a batch with
none has no `LogitBias` at all. Built on the host when the batch composition changes and copied
without waiting for the device; the biases never change while the rows stay.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from lmnb.runtime.kernels.metadata import device_tensor, host_int64, to_device

if TYPE_CHECKING:
    from lmnb.runtime.sampling.row import SamplingRow


class LogitBias:
    """`keys` [m] flat indices `row * vocab + token` of every biased (row, token) of the batch
    (distinct: a row names a token once) and `values` [m] float32 their biases."""

    def __init__(self, keys: list[int], values: list[float], device: torch.device) -> None:
        self.keys = to_device(host_int64(keys), device)
        self.values = device_tensor(values, torch.float32, device)

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], vocab_size: int,
              device: torch.device) -> LogitBias | None:
        keys: list[int] = []
        values: list[float] = []
        for i, row in enumerate(rows):
            bias = row.sampling_params.logit_bias
            if not bias:
                continue
            base = i * vocab_size
            for token, value in bias.items():
                if 0 <= token < vocab_size:  # requests are checked against the vocabulary
                    keys.append(base + token)
                    values.append(value)
        return cls(keys, values, device) if keys else None

    def apply_(self, logits: torch.Tensor) -> None:
        """Adds the biases to contiguous fp32 `logits` [bs, vocab] in place."""
        logits.view(-1).index_add_(0, self.keys, self.values)
