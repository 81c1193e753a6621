"""Logits -> next tokens: penalties, min-new-tokens and grammar masks, temperature, top-k, top-p,
min-p, seeded draws, and logprobs of the raw distribution.

Filtering follows HF transformers' warper chain (temperature, top-k, top-p over the top-k
renormalised set, min-p); penalties follow HF (repetition) and OpenAI/SGLang (frequency, presence).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmnb.runtime.core import Req

_NEG_INF = float("-inf")
_MIN_TEMPERATURE = 1e-5  # below this logits / T overflows; such rows are sampled greedily
_FIRST_WINDOW = 64  # candidates looked at first when cutting top-p; grows x8 when too few


@dataclass
class SampleOutput:
    next_token_ids: torch.Tensor  # [bs] int64
    next_token_logprobs: torch.Tensor  # [bs] float32, log_softmax of the raw logits at the token
    top_logprobs: list[list[tuple[float, int]]] | None  # per row (logprob, id), best first


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
            rows_t = torch.tensor(rows, device=raw.device)
            probs = self._filtered_probs(work, rows, reqs)
            ids = ids.clone()
            ids[rows_t] = self._draw(probs, [reqs[i] for i in rows])
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
        if rows:
            filtered = self._filtered_probs(work, rows, reqs)
            filtered /= filtered.sum(dim=-1, keepdim=True)
            probs[torch.tensor(rows, device=work.device)] = filtered
        return probs

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
        device = work.device
        sps = [reqs[i].sampling_params for i in rows]
        rows_t = torch.tensor(rows, device=device)
        counts = self._counts([reqs[i].output_ids for i in rows], device)
        logits = work[rows_t]
        reps = [sp.repetition_penalty for sp in sps]
        if any(r != 1.0 for r in reps):
            prompts = [reqs[i].origin_input_ids if sp.repetition_penalty != 1.0 else []
                       for i, sp in zip(rows, sps, strict=True)]
            seen = (counts > 0) | (self._counts(prompts, device) > 0)
            penalty = torch.tensor(reps, dtype=torch.float32, device=device)[:, None]
            scaled = torch.where(logits < 0, logits * penalty, logits / penalty)
            logits = torch.where(seen, scaled, logits)
        freqs = [sp.frequency_penalty for sp in sps]
        if any(freqs):
            logits -= torch.tensor(freqs, dtype=torch.float32, device=device)[:, None] * counts
        pres = [sp.presence_penalty for sp in sps]
        if any(pres):
            present = (counts > 0).float()
            logits -= torch.tensor(pres, dtype=torch.float32, device=device)[:, None] * present
        work[rows_t] = logits

    def _counts(self, id_lists: list[list[int]], device: torch.device) -> torch.Tensor:
        """[len(id_lists), vocab] float32 occurrence counts, ids outside the vocab ignored."""
        vocab = self.vocab_size
        counts = torch.zeros(len(id_lists) * vocab, dtype=torch.float32, device=device)
        flat = torch.tensor(list(itertools.chain.from_iterable(id_lists)), dtype=torch.int64)
        if flat.numel():
            lengths = torch.tensor([len(ids) for ids in id_lists])
            offsets = torch.repeat_interleave(torch.arange(len(id_lists)) * vocab, lengths)
            valid = (flat >= 0) & (flat < vocab)
            index = (flat + offsets)[valid].to(device)
            counts.scatter_add_(0, index, torch.ones_like(index, dtype=torch.float32))
        return counts.view(len(id_lists), vocab)

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

    def _filtered_probs(self, work: torch.Tensor, rows: list[int],
                        reqs: Sequence[Req]) -> torch.Tensor:
        """Unnormalised probabilities of the sampled rows after temperature/top-k/top-p/min-p."""
        device = work.device
        sps = [reqs[i].sampling_params for i in rows]
        temps = [sp.temperature for sp in sps]
        if len(rows) == work.shape[0]:
            logits = work
        else:
            logits = work[torch.tensor(rows, device=device)]
        if any(t != 1.0 for t in temps):
            logits = logits / torch.tensor(temps, dtype=torch.float32, device=device)[:, None]
        probs = torch.softmax(logits, dim=-1)
        vocab = probs.shape[1]
        top_ks = [sp.top_k if 0 < sp.top_k < vocab else vocab for sp in sps]
        top_ps = [sp.top_p for sp in sps]
        min_ps = [sp.min_p for sp in sps]
        cut = [j for j in range(len(rows)) if top_ks[j] < vocab or top_ps[j] < 1.0]
        if not cut and not any(min_ps):
            return probs
        threshold = torch.zeros(len(rows), dtype=torch.float32, device=device)
        if len(cut) == len(rows):
            threshold = _cut_threshold(probs, top_ks, top_ps)
        elif cut:
            cut_t = torch.tensor(cut, device=device)
            threshold[cut_t] = _cut_threshold(
                probs[cut_t], [top_ks[j] for j in cut], [top_ps[j] for j in cut])
        if any(min_ps):
            min_p = torch.tensor(min_ps, dtype=torch.float32, device=device)
            threshold = torch.maximum(threshold, min_p * probs.amax(dim=-1))
        return probs.masked_fill_(probs < threshold[:, None], 0.0)

    def _draw(self, probs: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        """One token per row by inverse CDF; rows with a generator draw alone with it, so their
        tokens do not depend on the rest of the batch."""
        device = probs.device
        seeded = [j for j, req in enumerate(reqs) if req.generator is not None]
        if not seeded:
            return _inverse_cdf(probs, torch.rand(len(reqs), 1, device=device))
        out = torch.empty(len(reqs), dtype=torch.int64, device=device)
        free = [j for j, req in enumerate(reqs) if req.generator is None]
        if free:
            free_t = torch.tensor(free, device=device)
            out[free_t] = _inverse_cdf(probs[free_t], torch.rand(len(free), 1, device=device))
        for j in seeded:
            generator = reqs[j].generator
            assert generator is not None
            uniform = torch.rand(1, 1, generator=generator, device=generator.device)
            out[j] = _inverse_cdf(probs[j : j + 1], uniform.to(device))[0]
        return out

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


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """[rows] token ids drawn from unnormalised `probs` given [rows, 1] uniforms in [0, 1)."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # Strictly below the total, so the first cdf entry above it belongs to a token with mass > 0.
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def _cut_threshold(probs: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """Per row, the smallest probability kept by top-k then top-p (nucleus over the top-k set,
    renormalised, always keeping the best token). Looks at a window of the best candidates and
    widens it (x8) only for the rows whose nucleus does not end inside it: no full sort unless a
    distribution is very flat.
    """
    rows, vocab = probs.shape
    device = probs.device
    k = torch.tensor(top_ks, device=device)
    p = torch.tensor(top_ps, dtype=torch.float32, device=device)[:, None]
    totals = probs.sum(dim=-1)
    out = torch.empty(rows, dtype=probs.dtype, device=device)
    todo = torch.arange(rows, device=device)
    window = min(vocab, max([_FIRST_WINDOW] + [kk for kk in top_ks if kk < vocab]))
    while True:
        part = probs if len(todo) == rows else probs[todo]
        values = part.topk(window, dim=-1).values
        cumulative = values.cumsum(dim=-1)
        has_k = k[todo] < vocab
        kept_k = k[todo].clamp(max=window)
        mass = cumulative.gather(1, (kept_k - 1)[:, None]).squeeze(1)
        total = torch.where(has_k, mass, totals[todo])
        before = (cumulative - values) / total[:, None]  # mass ranked strictly above, renormalised
        position = torch.arange(window, device=device)
        top_p = p[todo]
        keep = (position < kept_k[:, None]) & ((before < top_p) | (top_p >= 1.0))
        n_keep = keep.sum(dim=-1).clamp(min=1)
        done = has_k | (n_keep < window) | (window == vocab)
        out[todo[done]] = values.gather(1, (n_keep - 1)[:, None]).squeeze(1)[done]
        todo = todo[~done]
        if len(todo) == 0:
            return out
        window = min(vocab, window * 8)
