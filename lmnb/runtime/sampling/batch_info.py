"""A batch's sampling parameters as device tensors, built once per batch composition.

The caller keeps one `SamplingBatchInfo` while `matches(rows)` holds and calls `advance` with each
step's sampled ids; penalty counts and min_new_tokens counters then follow on the device, so a
decode step reads no Python lists of parameters.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from lmnb.runtime.kernels.metadata import device_tensor, to_device
from lmnb.runtime.sampling.bias import LogitBias
from lmnb.runtime.sampling.bitmask import num_words
from lmnb.runtime.sampling.penalties import MinNewTokens, Penalties
from lmnb.runtime.sampling.row import SamplingRow

if TYPE_CHECKING:
    from lmnb.runtime.core import SamplingParams

MIN_TEMPERATURE = 1e-5  # below this logits / T overflows; such rows are sampled greedily


def is_greedy(params: SamplingParams) -> bool:
    return params.is_greedy or params.temperature < MIN_TEMPERATURE


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return device_tensor(values, torch.float32, device)[:, None]


class RowGroup:
    """Sampled rows drawn the same way: `rows` [n] batch indices (device) with their parameters
    as [n, 1] columns; `whole_batch` when the group is every row of the batch."""

    def __init__(self, positions: list[int], params: list[SamplingParams], vocab_size: int,
                 batch_size: int, device: torch.device) -> None:
        self.positions = positions
        self.rows = device_tensor(positions, torch.int64, device)
        self.size = len(positions)
        self.vocab_size = vocab_size
        self.whole_batch = self.size == batch_size
        self.temperatures = _column([p.temperature for p in params], device)
        self.top_ps = _column([p.top_p for p in params], device)
        self.min_ps = _column([p.min_p for p in params], device)
        self.any_min_p = any(p.min_p > 0 for p in params)
        self.any_top_p = any(p.top_p < 1.0 for p in params)
        ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        self.top_ks = device_tensor(ks, torch.int64, device)
        self.has_k = self.top_ks < vocab_size
        self.max_cut_k = max((k for k in ks if k < vocab_size), default=0)  # 0: no top-k

    def take(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.whole_batch else logits[self.rows]


class RaceColumns:
    """Every row of a batch with a sampled row as `race.sample_rows` reads them, [bs] each:
    `rows` 0..bs-1, `temperatures` a sampled row's (0 for greedy rows: they take their largest
    logit), `floor_offsets` T log(min_p) of the full rows with a min-p (the floor below the row's
    largest logit; -inf elsewhere; None when no row has one), `no_floors` -inf. Cut rows' floors
    come from `thresholds` each step."""

    def __init__(self, params: list[SamplingParams], full: RowGroup | None,
                 cut: RowGroup | None, device: torch.device) -> None:
        full_rows = set() if full is None else set(full.positions)
        sampled = full_rows | (set() if cut is None else set(cut.positions))
        size = len(params)
        self.rows = torch.arange(size, device=device)
        temperatures = [p.temperature if i in sampled else 0.0 for i, p in enumerate(params)]
        self.temperatures = device_tensor(temperatures, torch.float32, device)
        self.no_floors = torch.full((size,), float("-inf"), device=device)
        self.floor_offsets = None
        if full is not None and full.any_min_p:
            min_ps = device_tensor([p.min_p if i in full_rows else 0.0
                                    for i, p in enumerate(params)], torch.float32, device)
            self.floor_offsets = torch.where(min_ps > 0, self.temperatures * torch.log(min_ps),
                                             self.no_floors)


class SamplingBatchInfo:
    """Sampling state of one batch of rows (see `SamplingRow`), on `device`.

    Rows are split, once, into greedy rows (argmax), `full` rows (temperature/min-p over the whole
    vocabulary) and `cut` rows (top-k and/or top-p: drawn over the whole vocabulary above a floor
    logit found each step, see thresholds.py).
    Valid for the same row objects while each row's `output_ids` is the same list grown only by
    the tokens given to `advance` (jump-forward replaces the list, so it forces a rebuild).
    """

    def __init__(self, rows: Sequence[SamplingRow], *, device: torch.device, vocab_size: int,
                 eos_ids: Iterable[int]) -> None:
        device = torch.device(device)
        self.rows = list(rows)
        self.device = device
        self.vocab_size = vocab_size
        self.batch_size = len(self.rows)
        self.num_words = num_words(vocab_size)
        params = [row.sampling_params for row in self.rows]
        eos = frozenset(eos_ids)
        self.stop_ids = [eos.union(p.stop_token_ids) for p in params]
        greedy = [is_greedy(p) for p in params]
        self.all_greedy = all(greedy)
        cut = [i for i, p in enumerate(params) if not greedy[i]
               and ((0 < p.top_k < vocab_size) or p.top_p < 1.0)]
        cut_set = set(cut)
        full = [i for i in range(len(params)) if not greedy[i] and i not in cut_set]
        self.full = (RowGroup(full, [params[i] for i in full], vocab_size, len(params), device)
                     if full else None)
        self.cut = (RowGroup(cut, [params[i] for i in cut], vocab_size, len(params), device)
                    if cut else None)
        self.race = (None if self.all_greedy
                     else RaceColumns(params, self.full, self.cut, device))
        self.generators = [(i, row.generator) for i, row in enumerate(self.rows)
                           if row.generator is not None and not greedy[i]]
        self.top_logprobs_nums = [min(max(row.top_logprobs_num, 0), vocab_size)
                                  for row in self.rows]
        self.max_top_logprobs = max(self.top_logprobs_nums, default=0)
        self.token_ids_logprobs = [row.token_ids_logprob or None for row in self.rows]
        self.token_ids_width = max(map(len, filter(None, self.token_ids_logprobs)), default=0)
        # Rows whose logprobs are computed (the others pay nothing); their indices on the device
        # when they are not the whole batch.
        self.logprob_positions = [i for i, row in enumerate(self.rows)
                                  if row.return_logprob or self.top_logprobs_nums[i] > 0
                                  or self.token_ids_logprobs[i]]
        self.need_logprobs = bool(self.logprob_positions)
        self.logprob_rows = (None if len(self.logprob_positions) == self.batch_size
                             else device_tensor(self.logprob_positions, torch.int64, device))
        # [logprob rows, token_ids_width] the ids each asked for (padded with 0); None if none did
        self.token_ids_matrix = None
        if self.token_ids_width:
            asked = [self.token_ids_logprobs[i] or [] for i in self.logprob_positions]
            self.token_ids_matrix = to_device(torch.tensor(
                [ids + [0] * (self.token_ids_width - len(ids)) for ids in asked],
                dtype=torch.int64), device)
        self.has_grammar = any(row.grammar is not None for row in self.rows)
        self.penalties = Penalties.build(self.rows, vocab_size, device)
        self.logit_bias = LogitBias.build(self.rows, vocab_size, device)
        self.min_new_tokens = MinNewTokens.build(self.rows, self.stop_ids, vocab_size, device)
        self._outputs = [row.output_ids for row in self.rows]
        self._output_lens = [len(ids) for ids in self._outputs]
        self._steps = 0

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], device: torch.device | str, vocab_size: int,
              eos_ids: Iterable[int]) -> SamplingBatchInfo:
        return cls(rows, device=torch.device(device), vocab_size=vocab_size, eos_ids=eos_ids)

    def matches(self, rows: Sequence[SamplingRow]) -> bool:
        """Whether this info still describes `rows` (same objects, outputs grown only by the
        tokens given to `advance`, the last of which may not be appended yet: the overlap
        schedule launches the next pass before processing the one in flight, and the state
        advanced on the device already counts its tokens). O(rows) attribute reads, no device
        work."""
        if len(rows) != self.batch_size:
            return False
        steps = self._steps
        for row, mine, outputs, length in zip(rows, self.rows, self._outputs, self._output_lens,
                                              strict=True):
            if (row is not mine or row.output_ids is not outputs
                    or not 0 <= length + steps - len(outputs) <= 1):
                return False
        return True

    def advance(self, next_token_ids: torch.Tensor) -> None:
        """Records one sampled id per row ([bs] device tensor; no sync). The caller appends the
        same ids to the rows' `output_ids` before the `matches` after the next one."""
        if self.penalties is not None:
            self.penalties.advance(next_token_ids)
        if self.min_new_tokens is not None:
            self.min_new_tokens.advance()
        self._steps += 1

    @property
    def adjusts_logits(self) -> bool:
        """Whether penalties, logit_bias or min_new_tokens blocks change the logits this
        step."""
        return self.penalties is not None or self.logit_bias is not None or (
            self.min_new_tokens is not None and self.min_new_tokens.active)

    def label(self, row: int) -> str:
        """How errors name row `row`."""
        rid = self.rows[row].rid
        return f"request {rid}" if rid is not None else f"row {row}"
