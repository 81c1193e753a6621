"""Overlap scheduling: the next decode pass is launched before the one in flight is processed.
The scheduler is stepped by hand with a fake runner that can `launch` (its tokens are decided
when the result is read, as a device would have them), then a tiny model runs through the
Runtime with overlap forced on the CPU; both must give exactly what the synchronous loop gives,
with KV integrity checked after every step."""

from __future__ import annotations

import pytest

from lmnb.runtime.core import ForwardMode
from tests.test_scheduler import EOS, FakeRunner, make, request, run_to_end


class FakePending:
    def __init__(self, runner: PipelinedFakeRunner, batch, rows) -> None:
        self.runner, self.batch, self.rows = runner, batch, rows

    def result(self):
        if self.runner.fail_on is not None and self.runner.fail_on(self.batch):
            raise RuntimeError("device fault")
        return FakeRunner.run(self.runner, self.batch, self.rows)


class PipelinedFakeRunner(FakeRunner):
    """`launch` defers the work to `result()`; `fail_on(batch)` makes a pass fail."""

    def __init__(self, token_for=None, fail_on=None) -> None:
        super().__init__(token_for)
        self.fail_on = fail_on

    def launch(self, batch, rows):
        return FakePending(self, batch, rows)


def eos_after(lengths: dict[int, int]):
    """Tokens 100, 101, ... and EOS once a prompt's first token's output reaches its length."""
    def token_for(row):
        n = len(row.output_ids)
        return EOS if n == lengths.get(row.origin_input_ids[0], -1) else 100 + n
    return token_for


def run_workload(overlap: bool, *, arrivals_at: int | None = None):
    token_for = eos_after({10: 3, 20: 7})
    runner = PipelinedFakeRunner(token_for) if overlap else FakeRunner(token_for)
    scheduler = make(chunk=64, runner=runner)
    scheduler.config.overlap_schedule = overlap
    states = [request([10 * k, 1, 2, 3], max_new_tokens=m)
              for k, m in ((1, 9), (2, 12), (3, 5), (4, 8))]
    for state in states:
        scheduler.add(state)
    late = request([50, 4, 5], max_new_tokens=4)
    steps = 0
    while scheduler.step():
        steps += 1
        if steps == arrivals_at:
            scheduler.add(late)
        assert steps < 200
    if arrivals_at is not None:
        states.append(late)
    return scheduler, [(s.req.output_ids, s.req.finished_reason) for s in states]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("fails_at", [0, 2])  # its first token (prefill pass), a decode step
def test_a_row_that_cannot_sample_ends_alone(overlap: bool, fails_at: int) -> None:
    """One request's row cannot sample (StepOutput.failed): it alone ends, with the reason,
    after the tokens it had; the others give the outputs of a run without it, pipelined or not
    (the pass launched behind the failed one drops that row)."""
    def token_for(row):
        if row.origin_input_ids[0] == 30 and len(row.output_ids) == fails_at:
            return "every token is masked"
        return eos_after({10: 3, 20: 7})(row)

    def run(with_failing: bool):
        runner = PipelinedFakeRunner(token_for) if overlap else FakeRunner(token_for)
        scheduler = make(chunk=64, runner=runner)
        scheduler.config.overlap_schedule = overlap
        states = [request([10 * k, 1, 2, 3], max_new_tokens=m)
                  for k, m in ((1, 9), (2, 12), (3, 5), (4, 8)) if with_failing or k != 3]
        for state in states:
            scheduler.add(state)
        steps = 0
        while scheduler.step():
            steps += 1
            assert steps < 200
        return {s.req.origin_input_ids[0]: (s.req.output_ids, s.req.finished_reason)
                for s in states}

    got, expected = run(True), run(False)
    ids, reason = got.pop(30)
    assert got == expected
    assert len(ids) == fails_at and reason["type"] == "abort"
    assert "every token is masked" in reason["message"]


@pytest.mark.parametrize("arrivals_at", [None, 4])
def test_pipelined_decode_gives_the_synchronous_outputs(arrivals_at) -> None:
    sync, expected = run_workload(False, arrivals_at=arrivals_at)
    pipelined, got = run_workload(True, arrivals_at=arrivals_at)
    assert got == expected
    follows = [b for b in pipelined.runner.batches if b.follows_previous]
    stats = pipelined.stats
    # decode passes follow decode passes, and prefill passes (the first decode pass, and the
    # first after the late request's prefill); the late request's prefill follows a decode pass
    late_prefill = 0 if arrivals_at is None else 1
    assert follows and (stats.overlapped_passes + stats.overlapped_prefill_passes
                        == len(follows) + late_prefill)
    assert stats.overlapped_prefill_passes == (1 if arrivals_at is None else 2)
    assert all(b.mode is ForwardMode.DECODE for b in follows)
    assert all(b.input_ids == [] for b in follows if -1 not in (b.previous_rows or []))
    assert not any(b.follows_previous for b in sync.runner.batches)
    assert pipelined.cache.allocator.available() + pipelined.cache.cache.evictable_size() \
        == pipelined.cache.allocator.size
    assert not pipelined.has_work


def test_a_request_ending_in_flight_drops_the_token_of_the_pass_after() -> None:
    runner = PipelinedFakeRunner(eos_after({10: 2}))
    scheduler = make(chunk=64, runner=runner)
    scheduler.config.overlap_schedule = True
    ends, goes_on = request([10, 1], max_new_tokens=20), request([20, 1], max_new_tokens=6)
    scheduler.add(ends)
    scheduler.add(goes_on)
    run_to_end(scheduler)
    assert ends.req.output_ids == [100, 101, EOS]
    assert goes_on.req.output_ids == [100, 101, 102, 103, 104, 105]
    # the pass launched while EOS was in flight still carried the ended request
    carried = [b for b in runner.batches if b.follows_previous and ends.rid in b.rids]
    assert len(carried) >= 1
    scheduler.check_integrity()


def test_abort_while_a_pass_is_in_flight() -> None:
    runner = PipelinedFakeRunner()
    scheduler = make(chunk=64, runner=runner)
    scheduler.config.overlap_schedule = True
    a, b = request([1, 2, 3], max_new_tokens=30), request([4, 5], max_new_tokens=10)
    scheduler.add(a)
    scheduler.add(b)
    for _ in range(4):
        scheduler.step()
    assert scheduler.pass_in_flight
    assert scheduler.abort(a.rid, "user abort")
    run_to_end(scheduler)
    assert a.req.finished_reason == {"type": "abort", "message": "user abort"}
    assert b.req.output_ids == list(range(100, 110))
    scheduler.check_integrity()
    assert scheduler.cache.allocator.available() + scheduler.cache.cache.evictable_size() \
        == scheduler.cache.allocator.size


def test_abort_while_its_prefill_pass_is_in_flight() -> None:
    """The decode pass planned behind a prefill pass in flight leaves out its aborted requests
    (it once looked their state up and failed the step, which aborted every request)."""
    scheduler = make(chunk=64, runner=PipelinedFakeRunner())
    scheduler.config.overlap_schedule = True
    a, b = request([1, 2, 3], max_new_tokens=8), request([4, 5, 6], max_new_tokens=8)
    scheduler.add(a)
    scheduler.add(b)
    assert scheduler.step() and scheduler.pass_in_flight  # both prompts' prefill pass
    assert scheduler.abort(a.rid, "user abort")
    run_to_end(scheduler)
    assert a.req.finished_reason == {"type": "abort", "message": "user abort"}
    assert b.req.output_ids == list(range(100, 108))
    scheduler.check_integrity()


def test_a_failing_pipelined_pass_aborts_its_requests_and_the_scheduler_goes_on() -> None:
    failed = []

    def fail_on(batch):
        if batch.follows_previous and not failed:
            failed.append(batch)
            return True
        return False

    runner = PipelinedFakeRunner(fail_on=fail_on)
    scheduler = make(chunk=64, runner=runner)
    scheduler.config.overlap_schedule = True
    a = request([1, 2, 3], max_new_tokens=8)
    scheduler.add(a)
    run_to_end(scheduler)
    assert a.req.finished_reason["type"] == "abort"
    assert "device fault" in a.req.finished_reason["message"]
    after = request([7, 8, 9], max_new_tokens=3)
    scheduler.add(after)
    run_to_end(scheduler)
    assert after.req.output_ids == [100, 101, 102]
    scheduler.check_integrity()


def test_runtime_with_overlap_forced_on_cpu_matches_the_synchronous_runtime(tiny_models):
    import lmnb
    from lmnb.lang.backends.local import LocalBackend
    from lmnb.runtime.engine import Runtime

    prompts = ["The cat sat on", "A list of colours: red,", "The cat sat on the mat and"]
    params = [{"max_new_tokens": n, "temperature": 0} for n in (9, 14, 5)]
    params[1]["stop"] = [" green"]
    # shared prefixes over several chunked prefill passes, pipelined with overlap
    story = ("Once upon a time in a small village by the sea there lived an old fisherman "
             "who every morning walked down to the harbour with his dog and his nets. ")
    questions = ("Who lived there?", "Where did he walk?", "What did he carry?", "Was there a dog?")
    shared = [story + question for question in questions]

    @lmnb.function
    def ask(s, question):
        s += story + question + lmnb.gen("a", max_tokens=4, temperature=0)

    results = {}
    for disable in (True, False):
        with Runtime(str(tiny_models["llama-gqa"]), dtype="float32", device="cpu",
                     disable_overlap_schedule=disable, check_integrity_each_step=True,
                     chunked_prefill_size=24) as rt:
            out = rt.generate(prompts, params)
            again = rt.generate(prompts[0], {"max_new_tokens": 12, "temperature": 0})
            mixed: list = []  # decode passes taking input ids from the prefill pass in flight
            rt.set_batch_hook(lambda b, mixed=mixed: mixed.append(-1 in (b.previous_rows or [])))
            fanned = rt.generate(shared, {"max_new_tokens": 6, "temperature": 0})
            rt.set_batch_hook(None)
            assert any(mixed) is (not disable)
            asked = [state["a"] for state in ask.run_batch(
                [{"question": q} for q in questions], backend=LocalBackend(rt))]
            stats = rt.stats()
            results[disable] = ([(o["text"], o["meta_info"]["finish_reason"]) for o in out],
                                again["text"],
                                [(o["output_ids"], o["meta_info"]["cached_tokens"])
                                 for o in fanned], asked)
            assert sum(o["meta_info"]["cached_tokens"] > 0 for o in fanned) >= 3
            assert stats["overlap_schedule"] is (not disable)
            assert (stats["overlapped_passes"] > 0) is (not disable)
            assert (stats["overlapped_prefill_passes"] > 0) is (not disable)
            rt.check_integrity()
    assert results[False] == results[True]


def test_overlap_is_on_by_default_only_on_cuda(tiny_models) -> None:
    from lmnb.runtime.engine import Runtime

    with Runtime(str(tiny_models["llama-mha"]), device="cpu") as rt:
        assert rt.stats()["overlap_schedule"] is False


def test_penalties_count_every_token_with_overlap(tiny_models) -> None:
    """The pass launched while one is in flight keeps the batch's sampling state (its device
    counts include the token not yet appended), so penalties see every output token."""
    from lmnb.runtime.engine import Runtime

    params = [{"max_new_tokens": 16, "temperature": 0, "frequency_penalty": 1.5},
              {"max_new_tokens": 16, "temperature": 0, "repetition_penalty": 1.8}]
    outputs = {}
    for disable in (True, False):
        with Runtime(str(tiny_models["llama-gqa"]), dtype="float32", device="cpu",
                     disable_overlap_schedule=disable) as rt:
            outputs[disable] = [o["output_ids"] for o in rt.generate(
                ["The cat sat on", "A list of colours: red,"], params)]
    assert outputs[False] == outputs[True]


def test_a_request_ending_by_length_does_not_stall_the_pipeline() -> None:
    """When requests have their last token in flight, the next pass carries the others
    (`previous_rows`), so every decode pass after the first follows the one before it."""
    runner = PipelinedFakeRunner(lambda row: 100 + len(row.output_ids))
    scheduler = make(chunk=64, runner=runner)
    scheduler.config.overlap_schedule = True
    states = [request([10 * k, 1, 2], max_new_tokens=m) for k, m in ((1, 3), (2, 6), (3, 4))]
    for state in states:
        scheduler.add(state)
    run_to_end(scheduler)
    assert [s.req.output_ids for s in states] == [[100 + i for i in range(m)] for m in (3, 6, 4)]
    decodes = [b for b in runner.batches if b.mode is ForwardMode.DECODE]
    assert all(b.follows_previous for b in decodes[1:])
    rids = [s.rid for s in states]
    subsets = [(b.rids, b.previous_rows) for b in decodes if b.previous_rows is not None]
    # the first request's last token is in flight: the pass after carries rows 1 and 2
    assert subsets[0] == ([rids[1], rids[2]], [1, 2])
    assert subsets[1] == ([rids[1]], [0])
    scheduler.check_integrity()


def test_requests_waiting_for_room_do_not_stall_the_pipeline() -> None:
    """When what waits cannot be admitted (here: no request slot; on a GPU: a full KV pool),
    the running requests' decode passes still follow each other and their prefill passes, and
    a waiting one is admitted behind the pass in flight once a slot is given back."""
    outputs = {}
    for overlap in (False, True):
        runner = PipelinedFakeRunner(eos_after({10: 2})) if overlap else FakeRunner(
            eos_after({10: 2}))
        scheduler = make(chunk=64, max_reqs=2, runner=runner)
        scheduler.config.overlap_schedule = overlap
        states = [request([10 * k, 1, 2], max_new_tokens=m)
                  for k, m in ((1, 8), (2, 9), (3, 4), (4, 3))]
        for state in states:
            scheduler.add(state)
        run_to_end(scheduler)
        outputs[overlap] = [(s.req.output_ids, s.req.finished_reason) for s in states]
        scheduler.check_integrity()
    assert outputs[True] == outputs[False]
    batches = runner.batches
    admitted_at = next(i for i, b in enumerate(batches)
                       if b.mode is ForwardMode.EXTEND and states[2].rid in b.rids)
    while_waiting = [b for b in batches[:admitted_at] if b.mode is ForwardMode.DECODE]
    assert len(while_waiting) >= 3
    assert all(b.follows_previous for b in while_waiting[1:])
    # the fourth still waits: the first decode pass of the third follows its prefill pass
    assert states[3].rid not in batches[admitted_at + 1].rids
    assert batches[admitted_at + 1].follows_previous
    assert outputs[True][2][0] == [100, 101, 102, 103]


def test_runtime_keeps_the_pipeline_across_requests_ending_by_length(tiny_models) -> None:
    """The same greedy tokens with overlap on and off, and the device-side token gather of the
    requests that go on picks each request's own token (different lengths, sampled rows)."""
    from lmnb.runtime.engine import Runtime

    prompts = ["The cat sat on", "A list of colours: red,", "Once upon a time", "1, 2, 3,"]
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in (3, 11, 6, 8)]
    params[2].update(temperature=0.9, seed=7)
    results, passes = {}, {}
    for disable in (True, False):
        with Runtime(str(tiny_models["llama-gqa"]), dtype="float32", device="cpu",
                     disable_overlap_schedule=disable, check_integrity_each_step=True) as rt:
            results[disable] = [o["output_ids"] for o in rt.generate(prompts, params)]
            stats = rt.stats()
            passes[disable] = (stats["forward_passes"], stats["overlapped_passes"])
    assert results[False] == results[True]
    assert [len(ids) for ids in results[False]] == [3, 11, 6, 8]
    total, overlapped = passes[False]
    assert overlapped == total - 2  # all but the prefill and the first decode pass


@pytest.mark.parametrize(("min_new_tokens", "subset"), [(2, True), (3, False)])
def test_a_subset_pass_waits_while_min_new_tokens_needs_the_token_in_flight(
        min_new_tokens, subset) -> None:
    """A subset pass rebuilds the sampling state from output ids that lack the token in flight:
    it is taken only when min_new_tokens is already reached without that token (here the other
    request's last token is in flight while this one has 2 outputs)."""
    runner = PipelinedFakeRunner(lambda row: 100 + len(row.output_ids))
    scheduler = make(chunk=64, runner=runner)
    scheduler.config.overlap_schedule = True
    ends = request([10, 1, 2], max_new_tokens=3)
    goes_on = request([20, 1, 2], max_new_tokens=6, min_new_tokens=min_new_tokens)
    scheduler.add(ends)
    scheduler.add(goes_on)
    run_to_end(scheduler)
    assert goes_on.req.output_ids == [100 + i for i in range(6)]
    first_subset = next((b for b in runner.batches if b.previous_rows is not None), None)
    assert (first_subset is not None and first_subset.rids == [goes_on.rid]) is subset
    scheduler.check_integrity()


def test_abort_all_after_a_second_failure_drops_the_prompts_cached_at_its_launch() -> None:
    """A scheduler error (the first failure) while a prefill pass is in flight: `abort_all`
    drains that pass, which fails too (the second). Its prompt was cached at launch and its KV
    never written: no later request may hit it."""
    failing = []

    def fail_on(batch):
        return batch.rids and batch.rids[0] in failing

    runner = PipelinedFakeRunner(fail_on=fail_on)
    scheduler = make(chunk=64, runner=runner)
    scheduler.config.overlap_schedule = True
    a = request([1, 2, 3, 4, 5, 6], max_new_tokens=4)
    b = request([40, 41, 42, 43, 44, 45, 46, 47], max_new_tokens=4)
    scheduler.add(a)
    assert scheduler.step() and scheduler.pass_in_flight  # a's prefill
    scheduler.add(b)
    failing.append(b.rid)

    def scheduler_error(batch):
        raise RuntimeError("a bug while processing a pass")

    scheduler.batch_hook = scheduler_error
    with pytest.raises(RuntimeError, match="a bug"):  # b's prefill launched, then a's processed
        scheduler.step()
    assert scheduler.pass_in_flight
    scheduler.batch_hook = None
    scheduler.abort_all("scheduler error")  # what the scheduler thread does next
    assert b.req.finished_reason["type"] == "abort"
    again = request(b.req.origin_input_ids, max_new_tokens=2)
    scheduler.add(again)
    run_to_end(scheduler)
    assert again.req.cached_tokens == 0  # b's void KV was not reused
    assert again.req.output_ids == [100, 101]
    scheduler.check_integrity()


def test_a_pass_in_flight_stays_drainable_when_planning_the_next_one_fails() -> None:
    """A scheduler error while planning the pass to launch behind a prefill pass in flight: that
    pass stays in flight for `abort_all`, which drains it; it fails, so its prompt, cached at
    launch, is dropped."""
    failing = []
    runner = PipelinedFakeRunner(fail_on=lambda batch: batch.rids[0] in failing)
    scheduler = make(chunk=64, runner=runner)
    scheduler.config.overlap_schedule = True
    a = request([1, 2, 3, 4, 5, 6], max_new_tokens=4)
    scheduler.add(a)
    assert scheduler.step() and scheduler.pass_in_flight  # a's prefill, failing when read
    failing.append(a.rid)
    policy = scheduler.prefill.policy

    class Exploding:
        def order(self, *args, **kwargs):
            raise RuntimeError("a bug while planning")

    scheduler.prefill.policy = Exploding()
    scheduler.add(request([40, 41, 42], max_new_tokens=4))
    with pytest.raises(RuntimeError, match="a bug"):
        scheduler.step()
    assert scheduler.pass_in_flight
    scheduler.prefill.policy = policy
    scheduler.abort_all("scheduler error")
    assert not scheduler.pass_in_flight and a.req.finished_reason["type"] == "abort"
    again = request(a.req.origin_input_ids, max_new_tokens=2)
    scheduler.add(again)
    run_to_end(scheduler)
    assert again.req.cached_tokens == 0 and again.req.output_ids == [100, 101]
    scheduler.check_integrity()
