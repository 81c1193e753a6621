"""The scheduler stepped by hand, without a thread or a model: a fake runner returns tokens, and
slot conservation is checked after every step (`check_integrity_each_step`)."""

from __future__ import annotations

import re

import pytest
import torch

from lmnb.runtime.core import ForwardMode, Req, ReqStatus, SamplingParams, StepOutput
from lmnb.runtime.memory import KVAllocator, ReqToTokenPool
from lmnb.runtime.policy import make_policy
from lmnb.runtime.prefix_cache import NoReuseCache
from lmnb.runtime.radix.cache import RadixCache
from lmnb.runtime.scheduler import (
    CacheManager,
    ReqState,
    Scheduler,
    SchedulerConfig,
    StopRules,
)

CPU = torch.device("cpu")
EOS = 2


class FakeRunner:
    """Samples `token_for(row)` for each sampling request (a str: the row could not sample, for
    that reason), scores the prompt tokens a batch asks for (logprob -1.0); records the batches
    it ran."""

    def __init__(self, token_for=None) -> None:
        self.batches = []
        self.token_for = token_for or (lambda row: 100 + len(row.output_ids))

    def run(self, batch, rows):
        self.batches.append(batch)
        out = StepOutput.empty(batch.size)
        sampling = iter(rows)
        for i, span in enumerate(batch.input_logprobs):
            if span is not None:
                out.input_logprobs[i] = [(-1.0, token) for token in span.targets]
                out.input_top_logprobs[i] = [None] * len(span.targets)
        for i, samples in enumerate(batch.samples):
            if samples:
                token = self.token_for(next(sampling))
                if isinstance(token, str):
                    out.failed[i] = token
                    continue
                out.next_token_ids[i] = token
                out.next_token_logprobs[i] = -1.0
        return out


class Sink:
    def __init__(self) -> None:
        self.events = []

    def put(self, events) -> None:
        self.events.extend(events)

    def finished(self, rid: int):
        return [e for e in self.events if e.rid == rid and e.finished_reason is not None]


def make(pool: int = 256, *, chunk: int = 16, reuse: bool = True, max_reqs: int = 8,
         runner: FakeRunner | None = None, tokenizer=None, jump_forward=None,
         policy: str = "fcfs", conservativeness: float = 1.0,
         exact_length_admission: bool = True) -> Scheduler:
    allocator = KVAllocator(pool, CPU)
    cache = RadixCache(allocator) if reuse else NoReuseCache(allocator)
    manager = CacheManager(cache, allocator, ReqToTokenPool(max_reqs, 256, CPU))
    config = SchedulerConfig(chunked_prefill_size=chunk, check_integrity_each_step=True,
                             exact_length_admission=exact_length_admission
                             ).conservative(conservativeness)
    return Scheduler(runner=runner or FakeRunner(), cache=manager, policy=make_policy(policy),
                     config=config, stop_rules=StopRules({EOS}), sink=Sink(),
                     tokenizer=tokenizer, jump_forward=jump_forward)


def request(prompt: list[int], **params) -> ReqState:
    return ReqState(Req(origin_input_ids=list(prompt), sampling_params=SamplingParams(**params)))


def run_to_end(scheduler: Scheduler, limit: int = 500) -> int:
    steps = 0
    while scheduler.step():
        steps += 1
        assert steps < limit
    return steps


def test_admission_fills_the_token_budget_and_chunks_the_last_request() -> None:
    scheduler = make(chunk=16)
    states = [request(range(10 * k, 10 * k + 10), max_new_tokens=2) for k in (1, 2, 3)]
    for state in states:
        scheduler.add(state)
    assert scheduler.step()
    batch = scheduler.runner.batches[-1]
    assert batch.mode is ForwardMode.EXTEND
    assert batch.extend_lens == [10, 6] and batch.samples == [True, False]
    assert scheduler.table.chunked is states[1].req
    assert scheduler.table.waiting == [states[2].req]
    assert states[1].req.status is ReqStatus.PREFILLING
    assert scheduler.step()
    batch = scheduler.runner.batches[-1]
    assert batch.rids[0] == states[1].rid and batch.extend_lens == [4, 10]
    run_to_end(scheduler)
    for state in states:
        assert state.req.output_ids == [100, 101]
        assert state.req.finished_reason == {"type": "length", "length": 2}
    assert not scheduler.has_work


@pytest.mark.parametrize("chunk", [16, 64])
def test_the_last_chunk_of_a_prompt_keeps_its_decode_reserve(chunk: int) -> None:
    """A request that may stop early decodes after its prompt's last chunk: its reserve counts
    when others are admitted beside that chunk, as when its prompt fits one pass (the second
    request was admitted beside the last chunk, then retracted)."""
    scheduler = make(pool=64, chunk=chunk)
    long = request(range(3, 23), max_new_tokens=40)
    other = request(range(30, 40), max_new_tokens=40)
    scheduler.add(long)
    scheduler.add(other)
    while long.req.kv_len < 20:
        scheduler.step()
    assert scheduler.table.waiting == [other.req]  # 20 + 0.7 * 40 kept of 64: 10 + 28 won't fit
    run_to_end(scheduler)
    assert scheduler.stats.retractions == 0
    assert other.req.output_ids == long.req.output_ids == list(range(100, 140))


def test_long_prompt_is_prefilled_in_chunks_and_samples_only_after_the_last() -> None:
    scheduler = make(chunk=16)
    state = request(range(3, 43), max_new_tokens=1)
    scheduler.add(state)
    run_to_end(scheduler)
    extends = [b for b in scheduler.runner.batches if b.mode is ForwardMode.EXTEND]
    assert [b.extend_lens for b in extends] == [[16], [16], [8]]
    assert [b.prefix_lens for b in extends] == [[0], [16], [32]]
    assert [b.samples for b in extends] == [[False], [False], [True]]
    assert [b.input_ids for b in extends] == [list(range(3, 19)), list(range(19, 35)),
                                              list(range(35, 43))]
    assert state.req.output_ids == [100]


def test_decode_batches_every_running_request_and_feeds_the_last_token() -> None:
    scheduler = make(chunk=64)
    a, b = request([5, 6, 7], max_new_tokens=3), request([8, 9], max_new_tokens=3)
    scheduler.add(a)
    scheduler.add(b)
    scheduler.step()
    scheduler.step()
    decode = scheduler.runner.batches[-1]
    assert decode.mode is ForwardMode.DECODE
    assert decode.input_ids == [100, 100] and decode.prefix_lens == [3, 2]
    assert decode.extend_lens == [1, 1] and len(decode.out_cache_loc) == 2
    table = scheduler.cache.table
    for req, slot in zip((a.req, b.req), decode.out_cache_loc.tolist(), strict=True):
        assert table[req.req_pool_idx, req.kv_len - 1].item() == slot


@pytest.mark.parametrize(("stop_param", "stop_token"), [({}, EOS), ({"stop_token_ids": [7]}, 7)])
def test_eos_and_stop_ids_end_requests_only_after_min_new_tokens(stop_param, stop_token) -> None:
    scheduler = make(runner=FakeRunner(lambda row: stop_token))
    state = request([1, 2, 3], max_new_tokens=10, min_new_tokens=2, **stop_param)
    scheduler.add(state)
    run_to_end(scheduler)
    assert state.req.output_ids == [stop_token] * 3
    assert state.req.finished_reason == {"type": "stop", "matched": stop_token}
    (event,) = scheduler.sink.finished(state.rid)
    assert event.new_token_ids == [stop_token]


def test_ignore_eos_runs_to_the_length_limit() -> None:
    scheduler = make(runner=FakeRunner(lambda row: EOS))
    state = request([1, 2, 3], max_new_tokens=4, ignore_eos=True)
    scheduler.add(state)
    run_to_end(scheduler)
    assert state.req.output_ids == [EOS] * 4 and state.req.finished_reason["type"] == "length"


def test_retraction_when_kv_runs_out_then_everyone_finishes() -> None:
    scheduler = make(pool=40, chunk=64)
    states = [request(range(10 * k, 10 * k + 8), max_new_tokens=14) for k in (1, 2, 3)]
    for state in states:
        scheduler.add(state)
    run_to_end(scheduler)
    assert scheduler.stats.retractions >= 1
    assert any(state.req.retractions for state in states)
    for state in states:
        assert state.req.output_ids == list(range(100, 114))
        assert state.req.finished_reason["type"] == "length"
    assert scheduler.cache.allocator.available() + scheduler.cache.cache.evictable_size() == 40


@pytest.mark.parametrize(("exact", "first_pass"), [(True, 1), (False, 2)])
def test_requests_that_only_the_length_limit_ends_are_admitted_by_their_peak(exact, first_pass):
    """The retraction test's work with `ignore_eos`: each request's future is known, so the
    second is admitted only when the pool holds both at their peak (2 x (8 + 14) > 40): none is
    ever retracted. The ablation (`exact_length_admission` off) reserves a share and retracts."""
    scheduler = make(pool=40, chunk=64, exact_length_admission=exact)
    states = [request(range(10 * k, 10 * k + 8), max_new_tokens=14, ignore_eos=True)
              for k in (1, 2, 3)]
    for state in states:
        scheduler.add(state)
    run_to_end(scheduler)
    assert (scheduler.stats.retractions == 0) == exact
    assert len(scheduler.runner.batches[0].rids) == first_pass
    for state in states:
        assert state.req.output_ids == list(range(100, 114))
    assert scheduler.cache.allocator.available() + scheduler.cache.cache.evictable_size() == 40


@pytest.mark.parametrize(("ignore_eos", "first_pass"), [(True, 3), (False, 2)])
def test_a_known_peak_admits_requests_whose_summed_reserve_does_not_fit(ignore_eos, first_pass):
    """Two short requests and a long one: at their peak (the long one's last token, after the
    short ones ended) they hold 8 + 24 = 32 of 40 slots, so all three start at once; reserving
    a share of every request's remaining tokens (when they may stop early) admits two."""
    scheduler = make(pool=40, chunk=64)
    states = [request(range(10 * k, 10 * k + 8), max_new_tokens=n, ignore_eos=ignore_eos)
              for k, n in ((1, 2), (2, 2), (3, 24))]
    for state in states:
        scheduler.add(state)
    run_to_end(scheduler)
    assert len(scheduler.runner.batches[0].rids) == first_pass
    assert scheduler.stats.retractions == 0
    for state in states:
        n = state.req.sampling_params.max_new_tokens
        assert state.req.output_ids == list(range(100, 100 + n))


def test_length_known_requests_sharing_a_prefix_in_a_tight_pool_all_finish() -> None:
    """Sharers of one computed prompt that end at different times: the peak counts a shared
    prefix as freed when its first holder ends, so a tight pool may be over-admitted; retraction
    catches it and every request still gets every token, with the slots conserved."""
    scheduler = make(pool=48, chunk=64)
    shared = list(range(10, 26))
    states = [request(shared + [k], max_new_tokens=n, ignore_eos=True)
              for k, n in ((1, 2), (2, 12), (3, 20), (4, 6))]
    for state in states:
        scheduler.add(state)
    run_to_end(scheduler)
    for state in states:
        n = state.req.sampling_params.max_new_tokens
        assert state.req.output_ids == list(range(100, 100 + n))
    assert scheduler.cache.allocator.available() + scheduler.cache.cache.evictable_size() == 48


def test_lpm_orders_requests_that_arrived_together_longest_output_first() -> None:
    """Equal cached prefixes: earlier arrivals first; within one arrival, most new tokens
    first (the batch's makespan); the cached prefix still comes before both."""
    scheduler = make(policy="lpm")
    cached = request([7, 8, 9, 10, 11], max_new_tokens=1)
    scheduler.add(cached)
    run_to_end(scheduler)
    reqs = [Req(origin_input_ids=[k, k + 1, k + 2], arrival_pass=passes,
                sampling_params=SamplingParams(max_new_tokens=n))
            for k, passes, n in ((20, 3, 5), (30, 3, 50), (40, 2, 1), (50, 3, 20))]
    hit = Req(origin_input_ids=[7, 8, 9, 10, 12], arrival_pass=3,
              sampling_params=SamplingParams(max_new_tokens=1))
    ordered = make_policy("lpm").order([*reqs, hit], scheduler.cache.cache, clock=4)
    assert [req.origin_input_ids[0] for req in ordered] == [7, 40, 30, 50, 20]


def test_conservativeness_scales_the_reserve_and_its_decay() -> None:
    default = SchedulerConfig()
    half = SchedulerConfig().conservative(0.5)
    assert (half.init_new_token_ratio, half.min_new_token_ratio) == (0.35, 0.05)
    passes = ((default.init_new_token_ratio - default.min_new_token_ratio)
              / default.new_token_ratio_decay)
    assert (half.init_new_token_ratio - half.min_new_token_ratio) / half.new_token_ratio_decay \
        == pytest.approx(passes)
    assert SchedulerConfig().conservative(1.0) == default
    assert SchedulerConfig().conservative(5.0).init_new_token_ratio == 1.0


@pytest.mark.parametrize(("factor", "first_pass"), [(1.0, 2), (0.0, 3)])
def test_a_low_conservativeness_admits_more_and_retracts_when_kv_runs_out(factor, first_pass):
    """The same work as the retraction test: with no reserve all three requests start in the
    first pass and retraction sorts out the pool; everyone still gets every token."""
    scheduler = make(pool=40, chunk=64, conservativeness=factor)
    states = [request(range(10 * k, 10 * k + 8), max_new_tokens=14) for k in (1, 2, 3)]
    for state in states:
        scheduler.add(state)
    run_to_end(scheduler)
    assert len(scheduler.runner.batches[0].rids) == first_pass
    for state in states:
        assert state.req.output_ids == list(range(100, 114))
    scheduler.check_integrity()


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_cache_aware_policies_admit_a_hit_before_a_request_that_would_evict_it(policy) -> None:
    """A cached prefix in a full pool: the request hitting it goes first and keeps the hit; the
    one sharing nothing (admitted first, it would evict the prefix) waits for it."""
    scheduler = make(pool=16, chunk=64, policy=policy)
    scheduler.add(request([1] * 10 + [5], max_new_tokens=1))
    run_to_end(scheduler)
    fresh, hit = request([9] * 12, max_new_tokens=1), request([1] * 10 + [6], max_new_tokens=1)
    scheduler.add(fresh)
    scheduler.add(hit)
    run_to_end(scheduler)
    assert [b.rids for b in scheduler.runner.batches[-2:]] == [[hit.rid], [fresh.rid]]
    assert hit.req.cached_tokens == 10


def test_abort_mid_prefill_frees_its_kv_and_unlocks_its_prefix() -> None:
    scheduler = make(chunk=8)
    shared = list(range(50, 60))
    first = request(shared, max_new_tokens=1)
    scheduler.add(first)
    run_to_end(scheduler)
    second = request(shared + list(range(70, 100)), max_new_tokens=4)
    scheduler.add(second)
    scheduler.step()
    assert scheduler.table.chunked is second.req and second.req.prefix_len > 0
    assert scheduler.abort(second.rid, "stop it")
    (event,) = scheduler.sink.finished(second.rid)
    assert event.finished_reason == {"type": "abort", "message": "stop it"}
    assert event.meta["finish_reason"]["type"] == "abort"
    assert not scheduler.has_work and second.req.req_pool_idx is None
    assert scheduler.cache.cache.protected_size() == 0
    scheduler.check_integrity()
    assert not scheduler.abort(second.rid)  # no longer live


def test_abort_of_waiting_and_running_requests() -> None:
    scheduler = make(chunk=4)
    running = request([1, 2, 3], max_new_tokens=50)
    waiting = request(list(range(10, 30)), max_new_tokens=5)
    scheduler.add(running)
    scheduler.step()
    scheduler.add(waiting)
    assert scheduler.abort(waiting.rid)
    scheduler.step()
    assert running.req.status is ReqStatus.RUNNING
    assert scheduler.abort(running.rid)
    assert not scheduler.has_work
    scheduler.check_integrity()
    assert scheduler.cache.cache.protected_size() == 0


def test_finished_requests_leave_prompt_and_output_in_the_cache() -> None:
    scheduler = make(chunk=64)
    state = request([4, 5, 6, 7], max_new_tokens=3)
    scheduler.add(state)
    run_to_end(scheduler)
    # The last sampled token has no KV: prompt (4) + the first two outputs are cached.
    assert scheduler.cache.cache.evictable_size() == 6
    again = request([4, 5, 6, 7, 100, 101, 9], max_new_tokens=1)
    scheduler.add(again)
    scheduler.step()
    assert again.req.cached_tokens == 6
    assert scheduler.runner.batches[-1].extend_lens == [1]


def test_a_decode_pass_sends_its_ends_before_handing_their_kv_to_the_cache() -> None:
    scheduler = make(chunk=64)
    sink = scheduler.sink
    handed: list[tuple[int, int]] = []  # (rid, ends the sink had got by then)
    cache_finished = scheduler.cache.cache_finished

    def recording(req):
        handed.append((req.rid, sum(e.finished_reason is not None for e in sink.events)))
        cache_finished(req)

    scheduler.cache.cache_finished = recording
    states = [request([4, 5, 6, 7 + i], max_new_tokens=3, ignore_eos=True) for i in range(4)]
    for state in states:
        scheduler.add(state)
    run_to_end(scheduler)
    assert sorted(rid for rid, _ in handed) == sorted(s.rid for s in states)
    assert all(ends == len(states) for _, ends in handed)  # all four ended in one pass
    assert scheduler.cache.cache.evictable_size() == 3 + 4 * 3  # shared 4, 1 + 2 outputs each


def test_a_failing_kv_hand_over_leaves_the_other_ended_requests_to_abort_all() -> None:
    scheduler = make(chunk=64)
    scheduler.config.check_integrity_each_step = False
    states = [request([4, 5, 6, 7 + i], max_new_tokens=2, ignore_eos=True) for i in range(4)]
    for state in states:
        scheduler.add(state)
    cache_finished, failed = scheduler.cache.cache_finished, []

    def failing_once(req):
        if not failed:
            failed.append(req.rid)
            raise RuntimeError("insert failed")
        cache_finished(req)

    scheduler.cache.cache_finished = failing_once
    with pytest.raises(RuntimeError):
        run_to_end(scheduler)
    scheduler.cache.cache_finished = cache_finished
    scheduler.abort_all("scheduler error")  # what the scheduler thread does next
    rows = scheduler.cache.req_to_token_pool
    assert rows.size - rows.available() == 1  # only the row whose hand-over failed is lost


def test_without_reuse_every_prompt_is_prefilled_whole() -> None:
    scheduler = make(chunk=64, reuse=False)
    for _ in range(2):
        state = request([4, 5, 6, 7], max_new_tokens=2)
        scheduler.add(state)
        run_to_end(scheduler)
        assert state.req.cached_tokens == 0
    assert scheduler.cache.allocator.available() == 256


def test_forward_failure_aborts_the_batch_and_the_scheduler_goes_on() -> None:
    class Failing(FakeRunner):
        def run(self, batch, rows):
            if len(self.batches) == 0:
                self.batches.append(batch)
                raise RuntimeError("boom")
            return super().run(batch, rows)

    scheduler = make(runner=Failing())
    bad = request([1, 2, 3], max_new_tokens=2)
    scheduler.add(bad)
    assert scheduler.step()
    assert bad.req.finished_reason["type"] == "abort" and "boom" in bad.req.finished_reason[
        "message"]
    good = request([1, 2, 3], max_new_tokens=2)
    scheduler.add(good)
    run_to_end(scheduler)
    assert good.req.output_ids == [100, 101]


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "dfs-weight", "lpm-fair"])
def test_policies_conserve_slots_under_pressure(policy: str) -> None:
    scheduler = make(pool=64, chunk=12, policy=policy, max_reqs=4)
    prefixes = [list(range(200, 210)), list(range(300, 306))]
    states = [request(prefixes[k % 2] + [k, k + 1], max_new_tokens=3 + k % 4) for k in range(10)]
    for state in states:
        scheduler.add(state)
    run_to_end(scheduler)
    for k, state in enumerate(states):
        assert len(state.req.output_ids) == 3 + k % 4
    assert scheduler.stats.cached_tokens > 0


@pytest.mark.parametrize("prompt_logprobs", [False, True])
def test_jump_forward_requeues_the_request_and_reprefills_on_its_cached_prefix(
        smollm2_dir, prompt_logprobs: bool):
    from lmnb.runtime.fsm.grammar import RequestGrammar
    from lmnb.runtime.fsm.index import get_token_index
    from lmnb.runtime.fsm.jump import JumpForward
    from lmnb.runtime.models.loader import load_tokenizer

    tokenizer = load_tokenizer(smollm2_dir)
    pattern = r'\{"name": "(ab|cd)", "size": [0-9]\}'
    index = get_token_index(pattern, tokenizer, vocab_size=len(tokenizer))

    def first_allowed(row) -> int:  # a "model" that obeys the grammar: the lowest allowed id
        return int(row.grammar.mask({EOS}).nonzero()[0, 0])

    scheduler = make(runner=FakeRunner(first_allowed), tokenizer=tokenizer,
                     jump_forward=JumpForward(tokenizer), chunk=64)
    state = request(tokenizer.encode("Give me JSON:"), max_new_tokens=40)
    state.grammar = RequestGrammar(index, pattern)
    if prompt_logprobs:  # scored once, at the first prefill: later ones reuse the cache too
        state.req.return_logprob, state.req.logprob_start_len = True, 0
    scheduler.add(state)
    run_to_end(scheduler)

    text = tokenizer.decode(state.req.output_ids, skip_special_tokens=True)
    assert re.fullmatch(pattern, text), text
    assert state.req.finished_reason["type"] == "stop"
    assert state.req.jumps >= 2 and scheduler.stats.jump_forward_tokens > 0
    replaced = [e for e in scheduler.sink.events if e.replace_output_ids is not None]
    assert len(replaced) == state.req.jumps
    assert replaced[-1].replace_output_ids == state.req.output_ids[:len(
        replaced[-1].replace_output_ids)]
    # After each jump the request is prefilled again, on the KV it left in the cache.
    extends = [b for b in scheduler.runner.batches if b.mode is ForwardMode.EXTEND]
    last, before = scheduler.sink.events[-1], scheduler.sink.events[-2]
    ended_by_a_jump = last.new_token_ids == [] and before.replace_output_ids is not None
    assert len(extends) == 1 + state.req.jumps - ended_by_a_jump
    prompt_len = len(state.req.origin_input_ids)
    assert all(b.prefix_lens[0] >= prompt_len for b in extends[1:])
    assert state.req.cached_tokens == 0  # counted once, at the first admission
    if prompt_logprobs:
        assert len(state.logprobs.input_token) == prompt_len


def test_check_integrity_finds_a_lock_that_nothing_holds() -> None:
    """A lock held by no live request and no pin passes the slot sums (its tokens only move from
    evictable to protected) but never comes off: the lock counts are checked too."""
    from lmnb.runtime.scheduler.cache_manager import IntegrityError

    scheduler = make(pool=32)
    scheduler.add(request(list(range(10, 20)), max_new_tokens=1))
    run_to_end(scheduler)
    scheduler.check_integrity()
    cache = scheduler.cache.cache
    cache.lock(cache.handle_of(list(range(10, 20))))
    with pytest.raises(IntegrityError, match="locked 1 times, held 0 times"):
        scheduler.check_integrity()


def _logprob_request(prompt: list[int], start: int) -> ReqState:
    return ReqState(Req(origin_input_ids=list(prompt), return_logprob=True,
                        logprob_start_len=start,
                        sampling_params=SamplingParams(max_new_tokens=2)))


def test_a_prompt_logprob_request_is_held_back_only_for_a_prefix_it_can_reuse() -> None:
    """A request sharing a long uncached prefix with one admitted before it waits a pass to hit
    it, unless the prompt positions it still has to score cover that prefix: those are computed
    whatever the cache holds, so waiting would gain nothing (from position 0: nothing at all;
    from 40: the 40 tokens before it, past the 32-token threshold)."""
    runner = FakeRunner()
    scheduler = make(pool=512, chunk=512, runner=runner)
    prompt = list(range(1000, 1060))
    states = [request(prompt, max_new_tokens=2), _logprob_request(prompt, 0),
              _logprob_request(prompt, 8), _logprob_request(prompt, 40),
              request(prompt, max_new_tokens=2)]
    for state in states:
        scheduler.add(state)
    assert scheduler.step()
    first = set(runner.batches[0].rids)
    assert first == {states[0].rid, states[1].rid, states[2].rid}
    run_to_end(scheduler)
    for state in states[1:4]:  # every prompt position from its start is scored, once
        start = state.req.logprob_start_len
        assert [t for _, t in state.logprobs.input_token] == prompt[start:]
    # waiting paid off where it was taken: 39 of the 40 ids before position 40, 59 of 60
    assert [state.req.cached_tokens for state in states] == [0, 0, 0, 39, 59]
    scheduler.check_integrity()


@pytest.mark.parametrize(("shared", "held"), [(31, False), (32, True), (5, False)])
def test_a_request_sharing_a_run_of_uncached_tokens_waits_for_it_from_the_threshold(
        shared: int, held: bool) -> None:
    """Held back a pass when it shares at least `in_batch_prefix_min_tokens` (32) uncached
    tokens with a request admitted in the same plan; a whole prompt shared with one admitted
    (the n samples' case) is held back however short."""
    runner = FakeRunner()
    scheduler = make(pool=512, chunk=512, runner=runner)
    common = list(range(1000, 1000 + shared))
    first = request(common + list(range(2000, 2010)), max_new_tokens=1)
    second = request(common + list(range(3000, 3010)), max_new_tokens=1)
    short, same = request([7, 8, 9], max_new_tokens=1), request([7, 8, 9], max_new_tokens=1)
    for state in (first, second, short, same):
        scheduler.add(state)
    assert scheduler.step()
    admitted = set(runner.batches[0].rids)
    assert (second.rid not in admitted) is held
    assert short.rid in admitted and same.rid not in admitted
    run_to_end(scheduler)
    assert second.req.cached_tokens == (shared if held else 0)
    assert same.req.cached_tokens == 2


def test_a_request_is_not_held_back_for_a_run_after_another_cached_prefix() -> None:
    """The admitted request must share the whole prefix up to the end of the run, not only the
    run: one whose cached prefix differs (the same length, other tokens) computes KV this
    request can never hit, so waiting for it gains nothing."""
    runner = FakeRunner()
    scheduler = make(pool=512, chunk=512, runner=runner)
    mine, theirs, run = list(range(500, 510)), list(range(600, 610)), list(range(1000, 1040))
    scheduler.add(request([*mine, 7], max_new_tokens=1))
    run_to_end(scheduler)  # `mine` is in the cache: the request below has 10 cached tokens
    other = request([*theirs, *run, 8], max_new_tokens=1)
    state = request([*mine, *run, 9], max_new_tokens=1)
    for s in (other, state):
        scheduler.add(s)
    assert scheduler.step()
    assert set(runner.batches[-1].rids) == {other.rid, state.rid}
    run_to_end(scheduler)
    assert state.req.cached_tokens == len(mine)
