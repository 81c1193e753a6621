"""Logits -> next tokens: penalties, min-new-tokens and grammar masks, temperature, top-k, top-p,
min-p, seeded draws, and logprobs of the raw distribution.

Filtering follows HF transformers' warper chain (temperature, top-k, top-p over the top-k
renormalised set, min-p); penalties follow HF (repetition) and OpenAI/SGLang (frequency, presence).
Rows cut by top-k/top-p never sort the vocabulary: they take a window of their best logits, cut and
draw inside it, and widen the window only when their nucleus does not end inside it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmnb.runtime.core import Req, SamplingParams

_NEG_INF = float("-inf")
_MIN_TEMPERATURE = 1e-5  # below this logits / T overflows; such rows are sampled greedily
_FIRST_WINDOW = 64  # best tokens a top-p row looks at first; grows x8 while its nucleus is wider


@dataclass
class SampleOutput:
    next_token_ids: torch.Tensor  # [bs] int64
    next_token_logprobs: torch.Tensor  # [bs] float32, log_softmax of the raw logits at the token
    # (zeros when no request of the batch asked for logprobs)
    top_logprobs: list[list[tuple[float, int]]] | None  # per row (logprob, id), best first


@dataclass
class _Support:
    """Some sampled rows and what they draw from: `probs` [rows, n] unnormalised, over the
    whole vocabulary when `ids` is None, else over the candidate ids `ids` [rows, n]."""

    positions: torch.Tensor  # indices into the list of sampled rows
    probs: torch.Tensor
    ids: torch.Tensor | None


def _is_greedy(req: Req) -> bool:
    sp = req.sampling_params
    return sp.is_greedy or sp.temperature < _MIN_TEMPERATURE


class Sampler:
    """Stateless per-step sampler; every input it needs is read from the requests."""

    def __init__(self, vocab_size: int, eos_token_ids: set[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)

    def __call__(self, logits: torch.Tensor, reqs: Sequence[Req],
                 vocab_mask: torch.Tensor | None = None) -> SampleOutput:
        """Sample one token per row. `vocab_mask` ([bs, >=vocab] bool, True = allowed) carries
        grammar constraints; the logprobs reported ignore it, like every other adjustment."""
        raw = self._raw(logits, reqs)
        work = self.adjusted_logits(raw, reqs, vocab_mask)
        best, ids = work.max(dim=-1)  # first maximal index, like argmax
        self._check_rows(best, reqs)
        rows = [i for i, req in enumerate(reqs) if not _is_greedy(req)]
        if rows:
            ids = ids.clone()
            ids[torch.tensor(rows, device=raw.device)] = self._sample(work, rows, reqs)
        if not any(req.return_logprob or req.top_logprobs_num for req in reqs):
            return SampleOutput(ids, torch.zeros(len(reqs), device=raw.device), None)
        lse = torch.logsumexp(raw, dim=-1)
        logprobs = raw.gather(1, ids[:, None]).squeeze(1) - lse
        return SampleOutput(ids, logprobs, self._top_logprobs(raw, lse, reqs))

    def adjusted_logits(self, logits: torch.Tensor, reqs: Sequence[Req],
                        vocab_mask: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits after penalties and masks, before temperature; never modifies `logits`."""
        raw = self._raw(logits, reqs)
        work = raw
        penalised = [i for i, req in enumerate(reqs) if req.sampling_params.has_penalties]
        if penalised:
            work = raw.clone()
            self._apply_penalties(work, penalised, reqs)
        block_rows, block_cols = self._blocked(reqs)
        if block_rows:
            if work is raw:
                work = raw.clone()
            work[torch.tensor(block_rows, device=work.device),
                 torch.tensor(block_cols, device=work.device)] = _NEG_INF
        if vocab_mask is not None:
            allowed = vocab_mask[:, : work.shape[1]].to(device=work.device, dtype=torch.bool)
            work = work.masked_fill(~allowed, _NEG_INF)
        return work

    def distribution(self, logits: torch.Tensor, reqs: Sequence[Req],
                     vocab_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[bs, vocab] normalised probabilities each row is drawn from (greedy rows: one-hot)."""
        work = self.adjusted_logits(logits, reqs, vocab_mask)
        best, ids = work.max(dim=-1)
        self._check_rows(best, reqs)
        probs = torch.zeros_like(work)
        probs[torch.arange(len(reqs), device=work.device), ids] = 1.0
        rows = [i for i, req in enumerate(reqs) if not _is_greedy(req)]
        if not rows:
            return probs
        rows_t = torch.tensor(rows, device=work.device)
        for support in _supports(work, rows_t, [reqs[i].sampling_params for i in rows]):
            target = rows_t[support.positions]
            normalised = support.probs / support.probs.sum(dim=-1, keepdim=True)
            if support.ids is None:
                probs[target] = normalised
            else:
                dense = torch.zeros(len(target), work.shape[1], device=work.device)
                probs[target] = dense.scatter_(1, support.ids, normalised)
        return probs

    def _sample(self, work: torch.Tensor, rows: list[int], reqs: Sequence[Req]) -> torch.Tensor:
        """Draw for the sampled rows. Rows with a generator are worked out and drawn alone with
        it, so their tokens do not depend on the rest of the batch."""
        device = work.device
        out = torch.empty(len(rows), dtype=torch.int64, device=device)
        free = [j for j, i in enumerate(rows) if reqs[i].generator is None]
        if free:
            batch_rows = torch.tensor([rows[j] for j in free], device=device)
            tokens = _draw(work, batch_rows, [reqs[rows[j]].sampling_params for j in free], None)
            out[torch.tensor(free, device=device)] = tokens
        for j, i in enumerate(rows):
            if reqs[i].generator is not None:
                batch_rows = torch.tensor([i], device=device)
                out[j] = _draw(work, batch_rows, [reqs[i].sampling_params], reqs[i].generator)[0]
        return out

    def _raw(self, logits: torch.Tensor, reqs: Sequence[Req]) -> torch.Tensor:
        if logits.dim() != 2 or logits.shape[0] != len(reqs):
            raise ValueError(f"logits must be [{len(reqs)}, vocab], got {tuple(logits.shape)}")
        return logits[:, : self.vocab_size].float()

    def _blocked(self, reqs: Sequence[Req]) -> tuple[list[int], list[int]]:
        """(row, id) pairs of EOS and stop ids that min_new_tokens still forbids."""
        rows: list[int] = []
        cols: list[int] = []
        for i, req in enumerate(reqs):
            sp = req.sampling_params
            if len(req.output_ids) >= sp.min_new_tokens:
                continue
            ids = [t for t in self.eos_token_ids.union(sp.stop_token_ids)
                   if 0 <= t < self.vocab_size]
            rows.extend([i] * len(ids))
            cols.extend(ids)
        return rows, cols

    def _apply_penalties(self, work: torch.Tensor, rows: list[int], reqs: Sequence[Req]) -> None:
        """Penalties touch only the (row, token) pairs that occur, so the cost is O(history)."""
        device = work.device
        rows_t = torch.tensor(rows, device=device)
        sps = [reqs[i].sampling_params for i in rows]
        reps = [sp.repetition_penalty for sp in sps]
        if any(r != 1.0 for r in reps):
            histories = [reqs[i].origin_input_ids + reqs[i].output_ids if r != 1.0 else []
                         for i, r in zip(rows, reps, strict=True)]
            local, col, _ = self._occurrences(histories, device)
            penalty = torch.tensor(reps, dtype=torch.float32, device=device)[local]
            row = rows_t[local]
            values = work[row, col]
            work[row, col] = torch.where(values < 0, values * penalty, values / penalty)
        freqs = [sp.frequency_penalty for sp in sps]
        pres = [sp.presence_penalty for sp in sps]
        if any(freqs) or any(pres):
            local, col, count = self._occurrences([reqs[i].output_ids for i in rows], device)
            freq_t = torch.tensor(freqs, dtype=torch.float32, device=device)[local]
            pres_t = torch.tensor(pres, dtype=torch.float32, device=device)[local]
            work[rows_t[local], col] -= freq_t * count + pres_t

    def _occurrences(self, id_lists: list[list[int]], device: torch.device
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Distinct (list index, token) pairs of `id_lists` with their counts; ids outside the
        vocab are ignored."""
        vocab = self.vocab_size
        flat = torch.tensor(list(itertools.chain.from_iterable(id_lists)), dtype=torch.int64)
        lengths = torch.tensor([len(ids) for ids in id_lists], dtype=torch.int64)
        owner = torch.repeat_interleave(torch.arange(len(id_lists)), lengths)
        valid = (flat >= 0) & (flat < vocab)
        keys, counts = torch.unique((owner * vocab + flat)[valid], return_counts=True)
        keys = keys.to(device)
        return keys // vocab, keys % vocab, counts.to(device=device, dtype=torch.float32)

    def _check_rows(self, best: torch.Tensor, reqs: Sequence[Req]) -> None:
        bad = ~torch.isfinite(best)
        if not bool(bad.any()):
            return
        i = int(bad.nonzero()[0, 0])
        value = float(best[i])
        if value == _NEG_INF:
            raise RuntimeError(
                f"request {reqs[i].rid}: every token is masked (min_new_tokens EOS/stop ids, "
                "grammar mask or -inf logits); nothing can be sampled")
        raise RuntimeError(f"request {reqs[i].rid}: logits contain {value} (NaN or +inf)")

    def _top_logprobs(self, raw: torch.Tensor, lse: torch.Tensor,
                      reqs: Sequence[Req]) -> list[list[tuple[float, int]]] | None:
        wants = [min(max(req.top_logprobs_num, 0), raw.shape[1]) for req in reqs]
        if not any(wants):
            return None
        rows = [i for i, want in enumerate(wants) if want]
        rows_t = torch.tensor(rows, device=raw.device)
        values, ids = raw[rows_t].topk(max(wants), dim=-1)
        values = (values - lse[rows_t, None]).tolist()
        ids = ids.tolist()
        out: list[list[tuple[float, int]]] = [[] for _ in reqs]
        for j, i in enumerate(rows):
            out[i] = list(zip(values[j][: wants[i]], ids[j][: wants[i]], strict=True))
        return out


def _draw(work: torch.Tensor, rows: torch.Tensor, sps: list[SamplingParams],
          generator: torch.Generator | None) -> torch.Tensor:
    out = torch.empty(len(rows), dtype=torch.int64, device=work.device)
    for support in _supports(work, rows, sps):
        gen_device = work.device if generator is None else generator.device
        uniform = torch.rand(len(support.positions), 1, generator=generator, device=gen_device)
        choice = _inverse_cdf(support.probs, uniform.to(work.device))
        if support.ids is not None:
            choice = support.ids.gather(1, choice[:, None]).squeeze(1)
        out[support.positions] = choice
    return out


def _supports(work: torch.Tensor, rows: torch.Tensor, sps: list[SamplingParams]) -> list[_Support]:
    """What the sampled rows `rows` of `work` (penalised, masked logits) draw from."""
    device = work.device
    vocab = work.shape[1]
    logits = work if len(rows) == work.shape[0] else work[rows]  # rows are ascending
    temps = torch.tensor([sp.temperature for sp in sps], dtype=torch.float32, device=device)
    top_ks = [sp.top_k if 0 < sp.top_k < vocab else vocab for sp in sps]
    cut = [j for j, sp in enumerate(sps) if top_ks[j] < vocab or sp.top_p < 1.0]
    full = sorted(set(range(len(sps))) - set(cut))
    supports = []
    if full:
        full_t = torch.tensor(full, device=device)
        part = logits if len(full) == len(sps) else logits[full_t]
        if any(sps[j].temperature != 1.0 for j in full):
            part = part / temps[full_t, None]
        probs = torch.softmax(part, dim=-1)
        min_ps = [sps[j].min_p for j in full]
        if any(min_ps):
            min_p = torch.tensor(min_ps, dtype=torch.float32, device=device)
            probs.masked_fill_(probs < (min_p * probs.amax(dim=-1))[:, None], 0.0)
        supports.append(_Support(full_t, probs, None))
    if cut:
        cut_t = torch.tensor(cut, device=device)
        part = logits if len(cut) == len(sps) else logits[cut_t]
        supports.extend(_cut_supports(
            part, cut_t, temps[cut_t], [top_ks[j] for j in cut], [sps[j].top_p for j in cut],
            [sps[j].min_p for j in cut]))
    return supports


def _cut_supports(logits: torch.Tensor, positions: torch.Tensor, temps: torch.Tensor,
                  top_ks: list[int], top_ps: list[float], min_ps: list[float]) -> list[_Support]:
    """Supports of rows cut by top-k (exactly k best) then top-p (the smallest set of best tokens
    whose mass, renormalised over the top-k set, reaches top_p) then min-p, each as a window of
    its best candidates."""
    rows, vocab = logits.shape
    device = logits.device
    k = torch.tensor(top_ks, device=device)
    p = torch.tensor(top_ps, dtype=torch.float32, device=device)[:, None]
    min_p = torch.tensor(min_ps, dtype=torch.float32, device=device)[:, None]
    has_k = k < vocab
    log_total = torch.zeros(rows, dtype=torch.float32, device=device)
    whole = [j for j, kk in enumerate(top_ks) if kk >= vocab]  # their top-p needs the normaliser
    if len(whole) == rows:
        log_total = torch.logsumexp(logits / temps[:, None], dim=-1)
    elif whole:
        whole_t = torch.tensor(whole, device=device)
        log_total[whole_t] = torch.logsumexp(logits[whole_t] / temps[whole_t, None], dim=-1)
    supports = []
    todo = torch.arange(rows, device=device)
    window = min(vocab, max([_FIRST_WINDOW] + [kk for kk in top_ks if kk < vocab]))
    while True:
        part = logits if len(todo) == rows else logits[todo]
        values, ids = part.topk(window, dim=-1)
        scaled = values / temps[todo, None]
        in_k = torch.arange(window, device=device) < k[todo].clamp(max=window)[:, None]
        scaled = scaled.masked_fill(~in_k, _NEG_INF)
        log_norm = torch.where(has_k[todo], torch.logsumexp(scaled, dim=-1), log_total[todo])
        probs = torch.exp(scaled - log_norm[:, None])
        before = probs.cumsum(dim=-1) - probs  # mass ranked strictly above each candidate
        keep = in_k & ((before < p[todo]) | (p[todo] >= 1.0))
        keep &= probs >= min_p[todo] * probs[:, :1]
        keep[:, 0] = True
        n_keep = keep.sum(dim=-1)
        done = has_k[todo] | (n_keep < window) | (window == vocab)
        if bool(done.any()):
            supports.append(_Support(positions[todo[done]], (probs * keep)[done], ids[done]))
        todo = todo[~done]
        if len(todo) == 0:
            return supports
        window = min(vocab, window * 8)


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """[rows] token ids drawn from unnormalised `probs` given [rows, 1] uniforms in [0, 1)."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # Strictly below the total, so the first cdf entry above it belongs to a token with mass > 0.
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)
