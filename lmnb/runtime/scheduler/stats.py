"""The scheduler's counters, and the per-request meta_info it reports when a request ends."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from lmnb.runtime.output.token_origins import prompt_spans
from lmnb.runtime.scheduler.request_state import ReqState


@dataclass(slots=True)
class SchedulerStats:
    forward_passes: int = 0
    overlapped_passes: int = 0  # decode passes launched before the decode pass before was processed
    overlapped_prefill_passes: int = 0  # passes launched before the prefill pass before was
    retractions: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    jump_forward_tokens: int = 0
    media_tokens: int = 0  # prompt tokens inside image/video spans
    cached_media_tokens: int = 0  # of them served from the prefix cache
    first_tokens: int = 0  # requests that produced a first output token
    first_token_seconds: float = 0.0  # summed time from their arrival to that token
    recent_hits: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=64))

    def counters(self) -> dict[str, Any]:
        counters = asdict(self)
        recent = counters.pop("recent_hits")
        counters["cache_hit_rate"] = self.cached_tokens / max(self.prompt_tokens, 1)
        counters["mean_first_token_latency"] = (self.first_token_seconds / self.first_tokens
                                                if self.first_tokens else None)
        counters["recent_cache_hit_rate"] = (sum(c for c, _ in recent)
                                             / max(sum(p for _, p in recent), 1))
        return counters


def request_meta(state: ReqState, *, weight_version: str) -> dict[str, Any]:
    """SGLang-style meta_info of a finished request. `total_retractions` is SGLang's name for
    `retractions` (kept: lmnb's readers use it); `reasoning_tokens` is 0, as SGLang's for a
    request without `require_reasoning` (lmnb takes none); `output_token_logprobs_length` comes
    with the logprobs."""
    req = state.req
    meta: dict[str, Any] = {
        "id": str(req.rid),
        "prompt_tokens": len(req.origin_input_ids),
        "completion_tokens": len(req.output_ids),
        "reasoning_tokens": 0,
        "cached_tokens": req.cached_tokens,
        "finish_reason": req.finished_reason,
        "weight_version": weight_version,
        "forward_passes": req.forward_passes,
        "retractions": req.retractions,
        "total_retractions": req.retractions,
        "e2e_latency": time.perf_counter() - state.created_at,
    }
    if state.first_token_at:
        meta["first_token_latency"] = state.first_token_at - state.created_at
    if state.grammar is not None:
        meta["jump_forward_steps"] = req.jumps
        meta["jump_forward_tokens"] = state.jumped_tokens
    if req.spec_verify_ct:  # SGLang's names; lengths count the target's own token per pass
        meta["spec_verify_ct"] = req.spec_verify_ct
        meta["spec_accept_token_num"] = req.spec_accepted_tokens
        meta["spec_draft_token_num"] = req.spec_draft_tokens
        meta["spec_accept_rate"] = req.spec_accepted_tokens / max(req.spec_draft_tokens, 1)
        meta["spec_accept_length"] = (req.spec_accepted_tokens + req.spec_verify_ct) \
            / req.spec_verify_ct
    if req.return_logprob:  # the prompt's lists are empty without logprob_start_len, as SGLang's
        logprobs = state.logprobs
        meta.update(prompt_lists(state))
        meta["output_token_logprobs"] = list(logprobs.output_token)
        meta["output_token_logprobs_length"] = len(logprobs.output_token)
        if req.top_logprobs_num:
            meta["output_top_logprobs"] = list(logprobs.output_top)
        if req.token_ids_logprob:
            meta["output_token_ids_logprobs"] = list(logprobs.output_token_ids)
    if state.origins is not None:
        meta["prompt_token_origins"] = prompt_spans(len(req.origin_input_ids), req.cached_tokens)
        meta["output_token_origins"] = state.origins.spans()
    return meta


def live_meta(state: ReqState, start: int) -> dict[str, Any]:
    """A running request's step `meta_info` when it asked for logprobs: where this step's ids go
    (`output_ids_from`) and their logprobs (`new_token_logprobs`, `new_top_logprobs`,
    `new_token_ids_logprobs` as asked), and with token origins the output's spans so far and its
    cached prompt tokens."""
    logprobs, req = state.logprobs, state.req
    meta: dict[str, Any] = {"output_ids_from": start,
                            "new_token_logprobs": logprobs.output_token[start:]}
    if req.top_logprobs_num:
        meta["new_top_logprobs"] = logprobs.output_top[start:]
    if req.token_ids_logprob:
        meta["new_token_ids_logprobs"] = logprobs.output_token_ids[start:]
    if state.origins is not None:
        meta["output_token_origins"] = state.origins.spans()
        meta["cached_tokens"] = req.cached_tokens
    return meta


def admission_meta(state: ReqState) -> dict[str, Any]:
    """The step `meta_info` of a request's first token after it was (re)admitted: its counts
    that change only then (`cached_tokens`, `total_retractions`) and, with logprobs, the
    prompt's lists (complete once it is prefilled), as `request_meta` gives them."""
    req = state.req
    meta: dict[str, Any] = {"cached_tokens": req.cached_tokens,
                            "total_retractions": req.retractions}
    if req.return_logprob:
        meta.update(prompt_lists(state))
    return meta


def prompt_lists(state: ReqState) -> dict[str, Any]:
    """A logprob request's prompt lists, those it asked for (copies)."""
    req, logprobs = state.req, state.logprobs
    lists: dict[str, Any] = {"input_token_logprobs": list(logprobs.input_token)}
    if req.top_logprobs_num:
        lists["input_top_logprobs"] = list(logprobs.input_top)
    if req.token_ids_logprob:
        lists["input_token_ids_logprobs"] = list(logprobs.input_token_ids)
    return lists
