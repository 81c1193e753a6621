"""Per-row state that changes each step: token penalties and min_new_tokens blocking.

Both are built on the device when the batch composition changes and advanced with each step's
sampled ids (device tensors, no host sync). Penalties follow HF (repetition: prompt and output
tokens) and OpenAI/SGLang (frequency, presence: output tokens).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lmnb.runtime.sampling.batch_info import SamplingRow

_NEG_INF = float("-inf")


def _occurrence_keys(id_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Flat indices `list index * vocab + token` of every in-vocab token of `id_lists`."""
    flat = torch.tensor(list(itertools.chain.from_iterable(id_lists)), dtype=torch.int64)
    lengths = torch.tensor([len(ids) for ids in id_lists], dtype=torch.int64)
    owner = torch.repeat_interleave(torch.arange(len(id_lists)), lengths)
    valid = (flat >= 0) & (flat < vocab)
    return (owner * vocab + flat)[valid].to(device)


class Penalties:
    """Dense penalty state of the penalised rows of a batch.

    `rows` [n] are batch row indices; `counts` [n, vocab] float32 counts each token in the row's
    output (frequency/presence; None when no row uses them); `seen` [n, vocab] bool marks tokens in
    the prompt or output (repetition; None when every repetition penalty is 1).
    """

    def __init__(self, rows: Sequence[SamplingRow], positions: list[int], vocab_size: int,
                 device: torch.device) -> None:
        params = [rows[i].sampling_params for i in positions]
        n = len(positions)
        self.vocab_size = vocab_size
        self.rows = torch.tensor(positions, dtype=torch.int64, device=device)
        self.whole_batch = n == len(rows)
        self.frequency = torch.tensor([[p.frequency_penalty] for p in params],
                                      dtype=torch.float32, device=device)
        self.presence = torch.tensor([[p.presence_penalty] for p in params],
                                     dtype=torch.float32, device=device)
        self.repetition = torch.tensor([[p.repetition_penalty] for p in params],
                                       dtype=torch.float32, device=device)
        self.counts: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None
        if any(p.frequency_penalty or p.presence_penalty for p in params):
            keys = _occurrence_keys([list(rows[i].output_ids) for i in positions], vocab_size,
                                    device)
            counts = torch.zeros(n * vocab_size, dtype=torch.float32, device=device)
            counts.index_add_(0, keys, torch.ones_like(keys, dtype=torch.float32))
            self.counts = counts.view(n, vocab_size)
        if any(p.repetition_penalty != 1.0 for p in params):
            histories = [list(rows[i].origin_input_ids) + list(rows[i].output_ids)
                         if p.repetition_penalty != 1.0 else []
                         for i, p in zip(positions, params, strict=True)]
            seen = torch.zeros(n * vocab_size, dtype=torch.bool, device=device)
            seen[_occurrence_keys(histories, vocab_size, device)] = True
            self.seen = seen.view(n, vocab_size)

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], vocab_size: int,
              device: torch.device) -> Penalties | None:
        positions = [i for i, row in enumerate(rows) if row.sampling_params.has_penalties]
        return cls(rows, positions, vocab_size, device) if positions else None

    def apply_(self, logits: torch.Tensor) -> None:
        """Penalises `logits` [bs, vocab] in place (repetition first, then frequency/presence)."""
        part = logits if self.whole_batch else logits[self.rows]
        if self.seen is not None:
            rep = self.repetition
            part = torch.where(self.seen, torch.where(part < 0, part * rep, part / rep), part)
        if self.counts is not None:
            part = part - (self.frequency * self.counts + self.presence * (self.counts > 0))
        if self.whole_batch:
            logits.copy_(part)
        else:
            logits[self.rows] = part

    def advance(self, next_token_ids: torch.Tensor) -> None:
        """Counts the batch's sampled ids [bs] (device) into the state."""
        picked = next_token_ids if self.whole_batch else next_token_ids[self.rows]
        picked = picked.clamp(0, self.vocab_size - 1)[:, None]  # failed rows (-1) are dropped
        if self.counts is not None:
            self.counts.scatter_add_(1, picked, torch.ones_like(picked, dtype=torch.float32))
        if self.seen is not None:
            self.seen.scatter_(1, picked, True)


class MinNewTokens:
    """Blocks each row's EOS and stop ids until it has `min_new_tokens` outputs.

    One entry per blocked (row, id) pair: `left` [p] counts the tokens still to produce before
    the pair is free; every row of the batch samples each step, so `advance` decrements all.
    """

    def __init__(self, pair_rows: list[int], pair_ids: list[int], left: list[int],
                 device: torch.device) -> None:
        self.pair_rows = torch.tensor(pair_rows, dtype=torch.int64, device=device)
        self.pair_ids = torch.tensor(pair_ids, dtype=torch.int64, device=device)
        self.left = torch.tensor(left, dtype=torch.int64, device=device)
        self.steps_left = max(left)  # host-side: after this many steps nothing is blocked

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], stop_ids: Sequence[Iterable[int]],
              vocab_size: int, device: torch.device) -> MinNewTokens | None:
        pair_rows: list[int] = []
        pair_ids: list[int] = []
        left: list[int] = []
        for i, (row, ids) in enumerate(zip(rows, stop_ids, strict=True)):
            missing = row.sampling_params.min_new_tokens - len(row.output_ids)
            if missing <= 0:
                continue
            blocked = sorted(t for t in ids if 0 <= t < vocab_size)
            pair_rows.extend([i] * len(blocked))
            pair_ids.extend(blocked)
            left.extend([missing] * len(blocked))
        return cls(pair_rows, pair_ids, left, device) if pair_rows else None

    @property
    def active(self) -> bool:
        return self.steps_left > 0

    def apply_(self, logits: torch.Tensor) -> None:
        values = logits[self.pair_rows, self.pair_ids]
        logits[self.pair_rows, self.pair_ids] = values.masked_fill(self.left > 0, _NEG_INF)

    def advance(self) -> None:
        self.left -= 1
        self.steps_left -= 1
