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

from lmnb.runtime.kernels.metadata import device_tensor, to_device

if TYPE_CHECKING:
    from lmnb.runtime.sampling.row import SamplingRow

_NEG_INF = float("-inf")


def _occurrence_keys(id_lists: list[list[int]], vocab: int, device: torch.device, *,
                     unique: bool = False) -> torch.Tensor:
    """Flat indices `list index * vocab + token` of every in-vocab token of `id_lists` (each
    once if `unique`), on `device`: computed on the host (a device `unique` or mask would wait
    for the pass in flight to size its result) and copied without waiting."""
    flat = torch.tensor(list(itertools.chain.from_iterable(id_lists)), dtype=torch.int64)
    lengths = torch.tensor([len(ids) for ids in id_lists], dtype=torch.int64)
    owner = torch.repeat_interleave(torch.arange(len(id_lists)), lengths)
    valid = (flat >= 0) & (flat < vocab)
    keys = (owner * vocab + flat)[valid]
    return to_device(keys.unique() if unique else keys, device)


class Penalties:
    """Penalty state of a batch, sized by history (repetition) and by vocabulary rows only for
    frequency/presence rows.

    Repetition: `rep_keys` [m] flat indices `row * vocab + token` of the tokens in each repetition
    row's prompt and output (duplicates allowed: each rewrites the same value) with the row's
    penalty in `rep_values` [m]. Frequency/presence: `counts` [n, vocab] float32 occurrences in the
    output of the rows `fp_rows` [n], and `neg_bias` [n, vocab] = -(frequency * count + presence
    * (count > 0)), added to the logits in one op and updated where a token is sampled.
    """

    def __init__(self, rows: Sequence[SamplingRow], vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.batch_size = len(rows)
        params = [row.sampling_params for row in rows]
        rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        fp = [i for i, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
        self.rep_rows = self.rep_penalty = self.rep_keys = self.rep_values = None
        if rep:
            self.rep_rows = device_tensor(rep, torch.int64, device)
            self.rep_penalty = device_tensor([params[i].repetition_penalty for i in rep],
                                             torch.float32, device)
            histories = [list(row.origin_input_ids) + list(row.output_ids)
                         if params[i].repetition_penalty != 1.0 else []
                         for i, row in enumerate(rows)]
            self.rep_keys = _occurrence_keys(histories, vocab_size, device, unique=True)
            penalty = device_tensor([p.repetition_penalty for p in params], torch.float32,
                                    device)
            self.rep_values = penalty[self.rep_keys // vocab_size]
        self.fp_rows = self.counts = self.neg_bias = None
        self.fp_whole_batch = len(fp) == len(rows)
        if fp:
            self.fp_rows = device_tensor(fp, torch.int64, device)
            self.frequency = device_tensor([params[i].frequency_penalty for i in fp],
                                           torch.float32, device)[:, None]
            self.presence = device_tensor([params[i].presence_penalty for i in fp],
                                          torch.float32, device)[:, None]
            keys = _occurrence_keys([list(rows[i].output_ids) for i in fp], vocab_size, device)
            counts = torch.zeros(len(fp) * vocab_size, dtype=torch.float32, device=device)
            counts.index_add_(0, keys, torch.ones_like(keys, dtype=torch.float32))
            self.counts = counts.view(len(fp), vocab_size)
            self.neg_bias = -(self.frequency * self.counts + self.presence * (self.counts > 0))

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], vocab_size: int,
              device: torch.device) -> Penalties | None:
        if not any(row.sampling_params.has_penalties for row in rows):
            return None
        return cls(rows, vocab_size, device)

    def apply_(self, logits: torch.Tensor) -> None:
        """Penalises contiguous `logits` [bs, vocab] in place (repetition first, like HF, then
        frequency/presence)."""
        if self.rep_keys is not None:
            flat = logits.view(-1)
            values = flat[self.rep_keys]
            flat[self.rep_keys] = torch.where(values < 0, values * self.rep_values,
                                              values / self.rep_values)
        if self.neg_bias is not None:
            if self.fp_whole_batch:
                logits.add_(self.neg_bias)
            else:
                logits.index_add_(0, self.fp_rows, self.neg_bias)

    def advance(self, next_token_ids: torch.Tensor) -> None:
        """Counts the batch's sampled ids [bs] (device) into the state."""
        ids = next_token_ids.clamp(0, self.vocab_size - 1)  # failed rows (-1) are dropped
        if self.rep_keys is not None:
            new_keys = self.rep_rows * self.vocab_size + ids[self.rep_rows]
            self.rep_keys = torch.cat([self.rep_keys, new_keys])
            self.rep_values = torch.cat([self.rep_values, self.rep_penalty])
        if self.counts is not None:
            picked = (ids if self.fp_whole_batch else ids[self.fp_rows])[:, None]
            self.counts.scatter_add_(1, picked, torch.ones_like(picked, dtype=torch.float32))
            count = self.counts.gather(1, picked)
            self.neg_bias.scatter_(1, picked, -(self.frequency * count + self.presence))


class MinNewTokens:
    """Blocks each row's EOS and stop ids until it has `min_new_tokens` outputs.

    One entry per blocked (row, id) pair: `left` [p] counts the tokens still to produce before
    the pair is free; every row of the batch samples each step, so `advance` decrements all.
    """

    def __init__(self, pair_rows: list[int], pair_ids: list[int], left: list[int],
                 device: torch.device) -> None:
        self.pair_rows = device_tensor(pair_rows, torch.int64, device)
        self.pair_ids = device_tensor(pair_ids, torch.int64, device)
        self.left = device_tensor(left, torch.int64, device)
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
