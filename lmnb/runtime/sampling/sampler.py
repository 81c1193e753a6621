"""Logits -> next tokens for a whole batch with tensor ops: penalties, logit_bias (after the
penalties, as in SGLang), min-new-tokens and grammar masks, temperature, top-k, top-p, min-p,
seeded draws, and logprobs of the raw distribution.

Filtering follows HF transformers' warper chain (temperature, top-k, top-p over the top-k
renormalised set, min-p), as one floor logit per row (thresholds.py; every token tied with the
floor is kept). Every sampled row draws by the exponential race (race.py) with noise from its own
seed over the tokens at or above its floor, so a seeded row's token depends only on its own logits
and generator.

Logits come in the model's dtype and are not copied unless something adjusts them (penalties,
logit_bias, min_new_tokens, a grammar mask: an fp32 copy); kernels and the torch ops that need
fp32 upcast as they read (exact), so bf16 logits sample exactly as their fp32 upcast would. On a
GPU, a batch with sampled rows reads each row once (`race.sample_rows`: draws, greedy ids and
verdicts), after the cut rows' few threshold passes (`thresholds.cut_floors`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from lmnb.runtime.sampling.batch_info import RowGroup, SamplingBatchInfo, SamplingRow
from lmnb.runtime.sampling.bitmask import apply_bitmask_
from lmnb.runtime.sampling.logprob_kernel import MAX_K, packed_logprobs
from lmnb.runtime.sampling.output import MASKED, NOT_FINITE, SampleOutput
from lmnb.runtime.sampling.race import greedy_rows, race_logits, row_seeds, sample_rows
from lmnb.runtime.sampling.thresholds import cut_floors, reference_floors

_NEG_INF = float("-inf")
_TOP_K_BLOCK = 128  # on the CPU, `top_k` reads the best blocks of this many values
# Where logprobs come from `logprob_kernel` and sampled rows from `race.sample_rows` (tests: also
# "cpu", the kernels in Triton's interpreter).
KERNEL_DEVICES = ("cuda",)


@dataclass
class _Support:
    """Some sampled rows and what they draw from: `probs` [rows, vocab] unnormalised."""

    positions: torch.Tensor  # [rows] batch row indices (device)
    probs: torch.Tensor


class Sampler:
    """Samples one token per row of a batch described by a `SamplingBatchInfo`."""

    def __init__(self, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)

    def batch_info(self, rows: list[SamplingRow], device: torch.device | str
                   ) -> SamplingBatchInfo:
        return SamplingBatchInfo.build(rows, device, self.vocab_size, self.eos_token_ids)

    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo,
                 bitmask: torch.Tensor | None = None) -> SampleOutput:
        """Sample one token per row of `logits` [bs, >= vocab] (any float dtype: bf16 is read as
        it is and upcast where the math needs it, which is exact). `bitmask` ([bs, words] int32,
        see bitmask.py) carries grammar constraints; reported logprobs ignore it, like every
        other adjustment (logit_bias too: SGLang reports the biased distribution). No host
        sync: the result's `synchronize()` is the step's one wait."""
        raw = self._raw(logits, info)
        work = self._adjusted(raw, info, bitmask)
        ids = _greedy_ids(work) if info.all_greedy else self.draw(work, info)
        packed = _token_logprobs(raw, ids, info) if info.need_logprobs else None
        return SampleOutput(ids, packed_logprobs=packed, top_width=info.max_top_logprobs,
                            top_logprobs_nums=info.top_logprobs_nums, label=info.label,
                            logprob_positions=info.logprob_positions,
                            token_ids_logprobs=info.token_ids_logprobs)

    def adjusted_logits(self, logits: torch.Tensor, info: SamplingBatchInfo,
                        bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits after penalties, logit_bias and masks, before temperature; never modifies
        `logits`."""
        return self._adjusted(self._raw(logits, info), info, bitmask).float()

    def distribution(self, logits: torch.Tensor, info: SamplingBatchInfo,
                     bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """[bs, vocab] normalised probabilities each row is drawn from (greedy rows: one-hot).
        For tests and inspection: it waits for the device."""
        work = self.adjusted_logits(logits, info, bitmask)
        best, ids = work.max(dim=-1)
        if not bool(torch.isfinite(best).all()):
            SampleOutput(_with_verdicts(ids, best), packed_logprobs=None, top_width=0,
                         top_logprobs_nums=info.top_logprobs_nums,
                         label=info.label).synchronize()
        return self.probabilities(work, info, ids)

    def probabilities(self, work: torch.Tensor, info: SamplingBatchInfo,
                      greedy_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[bs, vocab] normalised probabilities each row of `work` (`adjusted_logits`) is drawn
        from; greedy rows are one-hot at their first maximal logit (`greedy_ids` when known).
        No host sync; a row that cannot be sampled has no meaningful distribution."""
        if greedy_ids is None:
            greedy_ids = work.argmax(dim=-1)
        probs = torch.zeros_like(work)
        probs[torch.arange(len(greedy_ids), device=work.device), greedy_ids] = 1.0
        for support in _supports(work, info):
            probs[support.positions] = support.probs / support.probs.sum(dim=-1, keepdim=True)
        return probs

    def _raw(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        if (logits.dim() != 2 or logits.shape[0] != info.batch_size
                or logits.shape[1] < info.vocab_size):
            raise ValueError(f"logits must be [{info.batch_size}, >= {info.vocab_size}], "
                             f"got {tuple(logits.shape)}")
        return logits[:, : info.vocab_size]

    def _adjusted(self, raw: torch.Tensor, info: SamplingBatchInfo,
                  bitmask: torch.Tensor | None) -> torch.Tensor:
        """`raw` itself when nothing adjusts it, else an adjusted contiguous fp32 copy."""
        if not info.adjusts_logits and bitmask is None:
            return raw
        work = raw.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        if info.penalties is not None:
            info.penalties.apply_(work)
        if info.logit_bias is not None:  # before the masks: a biased token stays masked
            info.logit_bias.apply_(work)
        blocks = info.min_new_tokens is not None and info.min_new_tokens.active
        if bitmask is None:
            if blocks:
                info.min_new_tokens.apply_(work)
            return work
        if not blocks:
            apply_bitmask_(work, bitmask)
            return work
        # A grammar whose text is complete (or at a dead end) allows only the stop ids: it
        # outranks min_new_tokens there, so that the request ends instead of every token of
        # its row being masked.
        blocked = work.clone()
        info.min_new_tokens.apply_(blocked)
        apply_bitmask_(blocked, bitmask)
        apply_bitmask_(work, bitmask)
        stuck = (blocked == _NEG_INF).all(dim=-1, keepdim=True)
        return torch.where(stuck, work, blocked)

    def draw(self, work: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """[bs] ids of a batch with sampled rows from `work` (`adjusted_logits`; MASKED /
        NOT_FINITE for rows that cannot be sampled): greedy rows take their first maximal logit,
        the others race above their floor (min-p; cut rows: `thresholds`). Seeded rows take their
        seed from their own generator. On a GPU one read of each row gives the draws, the greedy
        rows' ids and every row's verdict (`race.sample_rows`), after the cut rows' threshold
        passes."""
        seeds = row_seeds(info.batch_size, info.generators, work.device)
        full, cut, race = info.full, info.cut, info.race
        assert race is not None
        if work.device.type in KERNEL_DEVICES:
            floors = race.no_floors
            if race.floor_offsets is not None:  # p >= min_p p_max <=> logit >= best + T log(min_p)
                floors = work.max(dim=-1).values.float() + race.floor_offsets
            if cut is not None:
                cut_rows = _cut_floors(work, cut)
                floors = (cut_rows if cut.whole_batch
                          else floors.index_copy(0, cut.rows, cut_rows))
            return sample_rows(work, race.rows, race.temperatures, floors, seeds)
        best, ids = work.max(dim=-1)  # first maximal index, like argmax
        if full is not None:
            floors = (torch.full_like(full.temperatures, _NEG_INF) if race.floor_offsets is None
                      else full.take((best.float() + race.floor_offsets)[:, None]))
            ids[full.rows] = race_logits(work, full.rows, full.temperatures, floors,
                                         seeds[full.rows])
        if cut is not None:
            ids[cut.rows] = race_logits(work, cut.rows, cut.temperatures,
                                        _cut_floors(work, cut)[:, None], seeds[cut.rows])
        return _with_verdicts(ids, best)


def _cut_floors(work: torch.Tensor, cut: RowGroup) -> torch.Tensor:
    """[n] floors of the cut rows of `work` [bs, V]: the Triton kernel on the kernel devices,
    its torch reference elsewhere."""
    if work.device.type in KERNEL_DEVICES:
        return cut_floors(work, cut)
    return reference_floors(cut.take(work), cut)


def _greedy_ids(work: torch.Tensor) -> torch.Tensor:
    """[bs] each row's first maximal index, like argmax, with the verdicts; one read of each row
    (on the kernel devices in one (row, slice) pass: torch's max over one long row is one slow
    block, 28 us for a 128k vocabulary on an H200 against 6)."""
    if work.device.type in KERNEL_DEVICES and work.stride(1) == 1:
        return greedy_rows(work)
    best, ids = work.max(dim=-1)
    return _with_verdicts(ids, best)


def _with_verdicts(ids: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    """`ids` with MASKED where the row's largest logit `best` is -inf, NOT_FINITE where it is NaN
    or +inf."""
    bad = ~torch.isfinite(best)
    return ids.masked_fill(bad, MASKED).masked_fill(bad & (best != _NEG_INF), NOT_FINITE)


def _token_logprobs(raw: torch.Tensor, ids: torch.Tensor, info: SamplingBatchInfo
                    ) -> torch.Tensor:
    """Of the rows that asked (`info.logprob_positions`, in order), packed for one copy to the
    host (`SampleOutput.packed_logprobs`): [n, 2 + 2 * max_top_logprobs (+ token_ids_width)]
    float32, the sampled id, its raw logprob, the best (logprob, id)s, then (when a row asked
    for `token_ids_logprob`) the logprobs of its ids. At batch 1 the host pays every op here
    per token: on a GPU one Triton launch (`logprob_kernel`; `torch.topk` alone launches a dozen
    kernels); elsewhere, or for wider top-k, one fused log-softmax pass (on the CPU a logsumexp
    costs several passes and a thread fork per call), a gather, a top-k and the packing `cat`
    (which promotes the int64 ids to float32 itself)."""
    if info.logprob_rows is not None:
        raw, ids = raw[info.logprob_rows], ids[info.logprob_rows]
    k = info.max_top_logprobs
    if raw.device.type in KERNEL_DEVICES and k <= MAX_K:
        packed = packed_logprobs(raw, ids, k)
    else:
        packed = torch_packed_logprobs(raw, ids, k)
    if info.token_ids_matrix is None:
        return packed
    # Rows that asked for given ids (rare): one more log-softmax, its columns packed after.
    asked = torch.log_softmax(raw, dim=-1, dtype=torch.float32).gather(1, info.token_ids_matrix)
    return torch.cat([packed, asked], dim=1)


def torch_packed_logprobs(raw: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """`logprob_kernel.packed_logprobs` in torch ops (any float dtype, computed in fp32)."""
    logprobs = torch.log_softmax(raw, dim=-1, dtype=torch.float32)
    column = ids.unsqueeze(1)
    chosen = logprobs.gather(1, column.clamp(min=0))  # [n, 1]
    if not k:
        return torch.cat([column, chosen], dim=1)
    top_values, top_ids = top_k(logprobs, k)
    return torch.cat([column, chosen, top_values, top_ids], dim=1)


def top_k(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`values.topk(k, dim=-1)` of [n, width] rows (best first; tied values in any order). On
    the CPU, from the k blocks of `_TOP_K_BLOCK` whose maxima are largest (the k best values
    lie in them): a vectorized max pass and two small top-k, where torch.topk copies each whole
    row into (value, index) pairs first (2-5x slower at a vocabulary's width)."""
    n, width = values.shape
    blocks = width // _TOP_K_BLOCK
    if values.device.type != "cpu" or width % _TOP_K_BLOCK or 4 * k > blocks:
        return values.topk(k, dim=-1)
    tiles = values.view(n, blocks, _TOP_K_BLOCK)
    best = tiles.amax(dim=-1).topk(k, dim=-1).indices  # [n, k] blocks
    candidates = tiles.gather(1, best[:, :, None].expand(n, k, _TOP_K_BLOCK))
    top, at = candidates.view(n, k * _TOP_K_BLOCK).topk(k, dim=-1)
    return top, best.gather(1, at // _TOP_K_BLOCK) * _TOP_K_BLOCK + at % _TOP_K_BLOCK


def _supports(work: torch.Tensor, info: SamplingBatchInfo) -> list[_Support]:
    """What the sampled rows of `work` (penalised, masked logits) draw from."""
    supports = []
    if (full := info.full) is not None:
        probs = torch.softmax(full.take(work) / full.temperatures, dim=-1)
        if full.any_min_p:
            probs.masked_fill_(probs < full.min_ps * probs.amax(dim=-1, keepdim=True), 0.0)
        supports.append(_Support(full.rows, probs))
    if (cut := info.cut) is not None:
        logits = cut.take(work)
        floors = _cut_floors(work, cut)
        probs = torch.softmax(logits / cut.temperatures, dim=-1, dtype=torch.float32)
        supports.append(_Support(cut.rows, probs.masked_fill(logits < floors[:, None], 0.0)))
    return supports
