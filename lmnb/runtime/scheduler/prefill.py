"""Prefill admission: which waiting requests join the next EXTEND pass, under a token budget
(`chunked_prefill_size`) and the KV room left after the running requests' reserve; what each
request's part of the pass samples and scores (`samples_after_fill`, `input_logprob_span`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from lmnb.runtime.core import InputLogprobSpan, Req
from lmnb.runtime.output.stop import by_length
from lmnb.runtime.policy import SchedulePolicy
from lmnb.runtime.scheduler.cache_manager import CacheManager
from lmnb.runtime.scheduler.decode import tokens_left
from lmnb.runtime.scheduler.kv_peak import KVPeak


@dataclass(slots=True)
class PrefillPlan:
    reqs: list[Req] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    admitted: list[Req] = field(default_factory=list)  # came from the waiting queue
    chunked: Req | None = None  # left with part of its prompt to prefill
    # unbound again after loading their cached prefix back failed: the scheduler ends them
    failed: list[tuple[Req, Exception]] = field(default_factory=list)


class PrefillManager:
    def __init__(self, cache: CacheManager, policy: SchedulePolicy, *, budget: int,
                 in_batch_prefix_min_tokens: int, length_known: Callable[[Req], bool]) -> None:
        self.cache = cache
        self.length_known = length_known  # admitted by its exact peak (DecodeManager's)
        self.policy = policy
        self.budget = budget
        self.in_batch_prefix_min_tokens = in_batch_prefix_min_tokens

    def plan(self, waiting: list[Req], chunked: Req | None, *, reserved: int, known: KVPeak,
             any_running: bool, new_token_ratio: float, clock: int) -> PrefillPlan | None:
        """Binds (matches and locks the prefix of) every request it admits; allocates nothing.
        `reserved`: KV the running requests that may stop early are expected to need; `known`:
        the running requests that only the length limit ends (`kv_peak.py`), to which it adds
        those of that kind it admits, each only if the set's peak fits. A request whose prefix
        fails to load back is left unbound in `failed`; the plan may hold only those."""
        plan = PrefillPlan()
        budget = self.budget
        planned = 0  # tokens this pass allocates plus the reserves of the requests it admits
        known_locked = known.held  # slots the known-length set holds (its prefixes locked)
        known_taken = 0  # of `planned`: the known-length requests' tokens this pass

        def beyond(peak: int, locked: int) -> int:
            """What the known-length set will still allocate at its peak, past this pass."""
            return max(peak - locked - known_taken, 0)

        def room() -> int:
            return self.cache.room() - reserved - planned - beyond(known.peak(), known_locked)

        if chunked is not None:
            remaining = chunked.fill_len - chunked.kv_len
            if self.length_known(chunked):  # its future is in the peak
                take = min(remaining, budget, max(self.cache.room() - reserved - planned, 0))
                known.add(chunked.fill_len, tokens_left(chunked))
                known_locked += chunked.kv_len
                known_taken += take
            else:
                take = min(remaining, budget, max(room(), 0))
            if take <= 0:
                return None
            plan.reqs.append(chunked)
            plan.extend_lens.append(take)
            budget -= take
            planned += take
            if take < remaining:
                plan.chunked = chunked
                return plan
            if not self.length_known(chunked):  # it decodes after this pass: its reserve too
                planned += int(tokens_left(chunked) * new_token_ratio)
        ordered = self.policy.order(waiting, self.cache.cache, clock)
        if ordered and not (any_running or plan.reqs
                            or any(map(self.cache.prefetched, ordered))):
            self.cache.wait_prefetch(ordered[0])  # nothing else can run: wait for its disk read
        for req in ordered:
            if budget <= 0 or not self.cache.has_request_slot():
                break
            if not self.cache.prefetched(req):  # its disk pages are being read: others first
                continue
            match = self.cache.match(req)
            prefix_len = match.length
            # what a tiered cache's host memory holds past the match is loaded, not computed
            if self._defer_for_shared_prefix(req, prefix_len + match.host_length, plan.reqs):
                continue
            self.cache.bind(req, match)  # locked: the prefix no longer counts as evictable room
            extend = req.fill_len - prefix_len
            length_known = self.length_known(req)
            alone = not (any_running or plan.reqs)  # admitted even if its reserve does not fit
            if length_known:  # fits if the set's peak with it does: nothing kept back beside
                reserve = 0
                peak = known.peak_with(req.fill_len, tokens_left(req))
                available = self.cache.room() - reserved - planned
                fits = beyond(peak, known_locked + prefix_len) <= available
            else:
                reserve = int(tokens_left(req) * new_token_ratio)
                available = room()
                fits = extend + reserve <= available
            if (not fits and not alone) or min(extend, budget, available) <= 0:
                self.cache.unbind(req)
                break
            # Admitted: the part of its prefix in a tiered cache's lower tiers comes back, each
            # token into the slot its recompute would have taken (so the fit above holds, and a
            # refused request loads nothing); a slot stays for the last token, always computed.
            try:
                loaded = self.cache.load_back(req, room=available - 1)
            except Exception as error:  # (a host copy or disk read failed) the rest go on
                self.cache.unbind(req)
                plan.failed.append((req, error))
                continue
            extend -= loaded
            take = min(extend, budget, available - loaded)
            if length_known:
                known.add(req.fill_len, tokens_left(req))
                known_locked += prefix_len + loaded
                known_taken += take
            plan.reqs.append(req)
            plan.extend_lens.append(take)
            plan.admitted.append(req)
            budget -= take
            planned += take + reserve
            if take < extend:
                plan.chunked = req
                break
        return plan if plan.reqs or plan.failed else None

    def _defer_for_shared_prefix(self, req: Req, cached_len: int, admitted: list[Req]) -> bool:
        """Holds back a request whose uncached prefix an admitted one is about to compute: once
        that one's prompt is in the cache, this one hits it. `cached_len`: its prefix on the
        device or in a lower tier. Only the prefix it may reuse counts (`match_key`: a request
        scoring prompt logprobs computes the positions it scores whatever the cache holds)."""
        threshold = self.in_batch_prefix_min_tokens
        if not self.cache.cache.reuses_kv or threshold <= 0:
            return False
        ids = self.cache.match_key(req)
        whole = len(ids) == req.fill_len
        uncached = len(ids) - cached_len
        if uncached <= 1:  # only its last token, computed whatever the cache holds: no gain
            return False  # (else a request jumping forward, back first each pass, starves it)
        # Long shared runs pay off; so does a whole shared prompt (e.g. the n samples): the
        # uncached tokens it must share with an admitted request (one slice compare each), after
        # the same cached prefix (else the other's KV is never a prefix of this one's).
        need = min(threshold, uncached - 1) if whole else threshold  # >= 1 either way
        end = cached_len + need
        if len(ids) < end:
            return False
        run = ids[cached_len:end]
        first = run[0]
        for other in admitted:
            other_ids = other.fill_ids
            if (other.extra_key != req.extra_key or len(other_ids) < end
                    or other_ids[cached_len] != first):  # shares no uncached token: quick out
                continue
            if other_ids[cached_len:end] == run and other_ids[:cached_len] == ids[:cached_len]:
                return True
        return False


def samples_after_fill(req: Req) -> bool:
    """Whether the pass that completes `req`'s fill samples a token: it has tokens left to
    generate, or (`max_new_tokens` 0, SGLang's) it asks for the next token's top logprobs or
    the logprobs of given ids (`token_ids_logprob`: SGLang's scoring)."""
    params = req.sampling_params
    return (by_length(params, len(req.output_ids)) is None
            or (params.max_new_tokens == 0
                and (req.top_logprobs_num > 0 or bool(req.token_ids_logprob))))


def input_logprob_span(req: Req, start: int, extend_len: int) -> InputLogprobSpan | None:
    """Prompt logprobs this chunk can score: the token at position t by the logits at t - 1."""
    if not req.wants_input_logprobs:
        return None
    first_target = max(req.input_logprobs_needed_from, 1, start + 1)
    last_target = min(start + extend_len, len(req.origin_input_ids) - 1)
    if first_target > last_target:
        return None
    return InputLogprobSpan(first_target, req.origin_input_ids[first_target:last_target + 1],
                            req.top_logprobs_num, req.token_ids_logprob)
