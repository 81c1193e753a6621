"""The verify step: the target's logits at every position of a verify pass (each request's last
token, then its drafts) -> the tokens each request keeps.

Row layout of one request with drafts d_0 .. d_{k-1} (its rows are consecutive in the batch):
```
row     0        1        ...  k
input   last     d_0      ...  d_{k-1}
checks  d_0      d_1      ...  (bonus: no draft)
```
Greedy rows accept the longest prefix of drafts equal to the argmax, then take the argmax where
the first draft failed (or after the last); sampled rows accept with the target probability and
resample from the residual (`sampling.rejection`). Logprobs are the target's raw ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmnb.runtime.core import TopLogprobs, VerifyOutput
from lmnb.runtime.fsm.protocol import Grammar
from lmnb.runtime.sampling import Sampler, SamplingBatchInfo, all_allowed, stack_bitmasks
from lmnb.runtime.sampling.output import MASKED, NOT_FINITE, unsampled_reason
from lmnb.runtime.sampling.rejection import NO_DRAFT, accept_or_resample
from lmnb.runtime.sampling.row import SamplingRow

_NEG_INF = float("-inf")


def expanded_rows(rows: Sequence[SamplingRow], drafts: Sequence[Sequence[int]]
                  ) -> list[SamplingRow]:
    """Each request's sampling row once per verify position (1 + its drafts)."""
    return [row for row, d in zip(rows, drafts, strict=True) for _ in range(len(d) + 1)]


def draft_bitmasks(rows: Sequence[SamplingRow], drafts: Sequence[Sequence[int]],
                   info: SamplingBatchInfo, device: torch.device) -> torch.Tensor | None:
    """[positions, words] packed allowed tokens at every verify position: a constrained
    request's grammar walked (on a fork) through its drafts, all-ones for the others."""
    if not info.has_grammar:
        return None
    ones = all_allowed(info.num_words, device)
    masks: list[torch.Tensor] = []
    for row, d in zip(rows, drafts, strict=True):
        stops = info.stop_ids[len(masks)]
        if row.grammar is None:
            masks.extend([ones] * (len(d) + 1))
            continue
        walker: Grammar | None = row.grammar.fork() if d else row.grammar
        if walker is None:
            raise RuntimeError("drafts were proposed for a grammar that cannot be forked")
        masks.append(walker.bitmask(stops, device))
        for token in d:
            walker.advance(token)
            masks.append(walker.bitmask(stops, device))
    return stack_bitmasks(masks, info.num_words)


def _sampled_rows(info: SamplingBatchInfo, device: torch.device) -> torch.Tensor:
    sampled = torch.zeros(info.batch_size, dtype=torch.bool, device=device)
    for group in (info.full, info.cut):
        if group is not None:
            sampled[group.rows] = True
    return sampled


def verify_drafts(sampler: Sampler, logits: torch.Tensor, info: SamplingBatchInfo,
                  bitmask: torch.Tensor | None, drafts: Sequence[Sequence[int]]) -> VerifyOutput:
    """`logits` [positions, >= vocab] of a verify pass and `info` over its `expanded_rows`
    -> per request the tokens it keeps. One wait for the device."""
    device = logits.device
    raw = logits[:, :info.vocab_size].float()
    work = sampler.adjusted_logits(logits, info, bitmask)
    best, greedy_ids = work.max(dim=-1)
    proposed = [token for d in drafts for token in (*d, NO_DRAFT)]
    draft_ids = torch.tensor(proposed, dtype=torch.int64).to(device, non_blocking=True)
    has_draft = draft_ids != NO_DRAFT
    greedy_accepted = has_draft & (draft_ids == greedy_ids)
    if info.all_greedy:
        accepted, token = greedy_accepted, greedy_ids
    else:
        # Rows without a draft draw as a decode step would (a seeded row, which never drafts,
        # from its own generator); a rejected draft's row resamples from the residual.
        probs = sampler.probabilities(work, info, greedy_ids)
        u_accept, u_draw = torch.rand(2, info.batch_size, device=device)
        accepted, resampled = accept_or_resample(probs, draft_ids, u_accept, u_draw)
        token = torch.where(has_draft, resampled, sampler.draw(work, info))
        sampled = _sampled_rows(info, device)
        accepted = torch.where(sampled, accepted, greedy_accepted)
        token = torch.where(sampled, token, greedy_ids)
    bad = ~torch.isfinite(best)
    accepted = accepted & ~bad
    token = token.masked_fill(bad, MASKED).masked_fill(bad & (best != _NEG_INF), NOT_FINITE)
    columns = [accepted.to(torch.int64), token]
    logprob_rows: torch.Tensor | None = None
    top: tuple[torch.Tensor, torch.Tensor] | None = None
    asked: torch.Tensor | None = None
    if info.need_logprobs:
        lse = torch.logsumexp(raw, dim=-1)
        logprob_rows = torch.stack([
            raw.gather(1, draft_ids.clamp(min=0)[:, None]).squeeze(1) - lse,
            raw.gather(1, token.clamp(min=0)[:, None]).squeeze(1) - lse]).cpu()
        if info.max_top_logprobs:
            values, ids = raw.topk(info.max_top_logprobs, dim=-1)
            top = ((values - lse[:, None]).cpu(), ids.cpu())
        if width := info.token_ids_width:
            index = torch.tensor([(ids or []) + [0] * (width - len(ids or []))
                                  for ids in info.token_ids_logprobs], dtype=torch.int64)
            asked = (raw.gather(1, index.to(device)) - lse[:, None]).cpu()
    accepted_host, token_host = torch.stack(columns).cpu().tolist()
    return _collect(drafts, accepted_host, token_host, logprob_rows, top, asked, info)


def _collect(drafts: Sequence[Sequence[int]], accepted: list[int], token: list[int],
             logprob_rows: torch.Tensor | None, top: tuple[torch.Tensor, torch.Tensor] | None,
             asked: torch.Tensor | None, info: SamplingBatchInfo) -> VerifyOutput:
    """Walks each request's rows on the host: its accepted prefix, then the drawn token.
    `asked` [positions, token_ids_width]: the logprobs of each row's `token_ids_logprob`."""
    lp_draft = lp_token = None
    if logprob_rows is not None:
        lp_draft, lp_token = logprob_rows.tolist()
    top_values = top_ids = None
    if top is not None:
        top_values, top_ids = (t.tolist() for t in top)
    asked_rows = None if asked is None else asked.tolist()
    out = VerifyOutput([], [], [], [])
    start = 0
    for i, d in enumerate(drafts):
        a = 0
        while a < len(d) and accepted[start + a]:
            a += 1
        row = start + a
        if token[row] < 0:  # it alone ends, with the reason
            out.failed[i] = f"{info.label(row)}: {unsampled_reason(token[row])}"
            out.tokens.append([])
            out.logprobs.append([])
            out.top_logprobs.append([])
            out.token_ids_logprobs.append([])
            start += len(d) + 1
            continue
        out.tokens.append([*d[:a], token[row]])
        if lp_draft is not None and lp_token is not None:
            out.logprobs.append([*lp_draft[start:row], lp_token[row]])
        else:
            out.logprobs.append([0.0] * (a + 1))
        tops: list[TopLogprobs | None] = [None] * (a + 1)
        if top_values is not None and top_ids is not None:
            tops = [list(zip(top_values[r][:info.top_logprobs_nums[r]],
                             top_ids[r][:info.top_logprobs_nums[r]], strict=True))
                    for r in range(start, row + 1)]
        out.top_logprobs.append(tops)
        out.token_ids_logprobs.append(
            [None if asked_rows is None or not (ids := info.token_ids_logprobs[r])
             else list(zip(asked_rows[r][:len(ids)], ids, strict=True))
             for r in range(start, row + 1)])
        start += len(d) + 1
    return out
