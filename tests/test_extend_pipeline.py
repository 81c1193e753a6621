"""Prefill passes in the overlap schedule: the next EXTEND pass is launched before the one in
flight is processed; its prompts went into the radix tree at launch, so requests sharing them
are admitted on them; the host does no per-request device work between passes. Stepped by hand
with the pipelined fake runner (tokens decided when a result is read), KV integrity checked after
every step."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.overrides import TorchFunctionMode

from lmnb.runtime.core import ForwardMode
from tests.test_overlap_schedule import PipelinedFakeRunner
from tests.test_scheduler import FakeRunner, make, request

PREFIX = 40


class RecordingRunner(PipelinedFakeRunner):
    """Records, per launched batch, how many launched passes were still unprocessed."""

    def __init__(self, token_for=None, fail_on=None) -> None:
        super().__init__(token_for, fail_on)
        self.unprocessed = 0
        self.launches: list[tuple[ForwardMode, int]] = []
        self.launched = []

    def launch(self, batch, rows):
        self.launches.append((batch.mode, self.unprocessed))
        self.launched.append(batch)
        self.unprocessed += 1
        pending = super().launch(batch, rows)
        result = pending.result

        def counted():
            self.unprocessed -= 1
            return result()
        pending.result = counted
        return pending


def token_for(row):
    return 100 + len(row.output_ids) + row.origin_input_ids[-1] % 5


def shared_prefix_states(prefixes: int, sharers: int):
    states = []
    for p in range(prefixes):
        prefix = [1000 + 100 * p + i for i in range(PREFIX)]
        states += [request(prefix + [10 + q, 20 + q, 30 + q], max_new_tokens=3)
                   for q in range(sharers)]
    return states


def run(prefixes: int, sharers: int, *, overlap: bool, count_ops: bool = False):
    runner = RecordingRunner(token_for) if overlap else FakeRunner(token_for)
    scheduler = make(pool=4096, chunk=64, max_reqs=prefixes * sharers, runner=runner)
    scheduler.config.overlap_schedule = overlap
    states = shared_prefix_states(prefixes, sharers)
    for state in states:
        scheduler.add(state)
    ops_per_extend_step: list[int] = []
    steps = 0
    while True:
        launched = len(runner.batches) if not overlap else len(runner.launches)
        counter = OpCounter()
        with counter if count_ops else contextlib.nullcontext():
            if not scheduler.step():
                break
        extended = (runner.launches[launched:] if overlap else
                    [(b.mode, 0) for b in runner.batches[launched:]])
        assert_rows_read_the_tree(scheduler)
        if count_ops and any(mode is ForwardMode.EXTEND for mode, _ in extended):
            ops_per_extend_step.append(counter.ops)
        steps += 1
        assert steps < 500
    scheduler.check_integrity()
    return scheduler, states, ops_per_extend_step


def assert_rows_read_the_tree(scheduler) -> None:
    """Every live request's KV row holds the slots the radix tree holds for its tokens (its
    prompt went into the tree at launch; runs another request cached first are re-pointed)."""
    manager = scheduler.cache
    for req in scheduler.table.live():
        if req.prefix_len != req.kv_len:
            continue  # a running request's decoded tokens are its own until it ends
        key = req.fill_slice(0, req.kv_len)
        match = manager.cache.match_all(key, req.extra_key)
        assert match.length == req.kv_len
        assert manager.table[req.req_pool_idx, :req.kv_len].tolist() == match.indices.tolist()


class OpCounter(TorchFunctionMode):
    """Counts tensor operations that would be kernels on a device: every torch function but
    views and metadata (indexing without tensor indices, `view`, sizes, properties)."""

    METADATA = frozenset({"__len__", "view", "stride", "numel", "size", "dim", "__get__"})

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name == "__getitem__":
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            self.ops += any(isinstance(i, torch.Tensor) for i in index)
        elif name not in self.METADATA:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def test_extend_passes_are_pipelined_with_the_synchronous_outputs() -> None:
    sync, sync_states, _ = run(3, 6, overlap=False)
    pipelined, states, _ = run(3, 6, overlap=True)
    assert ([s.req.output_ids for s in states]
            == [s.req.output_ids for s in sync_states])
    assert all(len(s.req.output_ids) == 3 for s in states)
    # the same passes, each with the same requests and lengths
    def passes(scheduler, states):
        index = {s.rid: i for i, s in enumerate(states)}
        return [(b.mode, [index[rid] for rid in b.rids], b.extend_lens)
                for b in scheduler.runner.batches]
    assert passes(pipelined, states) == passes(sync, sync_states)
    # an EXTEND pass was launched while the one before it was unprocessed, and the sharers
    # admitted then hit the prefix that pass was computing
    launches = pipelined.runner.launches
    assert any(mode is ForwardMode.EXTEND and unprocessed == 1
               and launches[i - 1][0] is ForwardMode.EXTEND
               for i, (mode, unprocessed) in enumerate(launches) if i)
    cached = [s.req.cached_tokens for s in states]
    assert cached == [s.req.cached_tokens for s in sync_states]
    assert sum(c > 0 for c in cached) == 3 * 5  # all but the first of each prefix hit
    assert not pipelined.has_work


def test_no_per_request_device_work_between_extend_passes() -> None:
    """Tensor operations (kernels on a device) of the steps that launch an EXTEND pass: as
    many for passes of 16 requests as for passes of 4 (the pass's rows written in one indexed
    write, its slots copied once for the radix tree)."""
    small_sched, _, small = run(2, 4, overlap=True, count_ops=True)
    large_sched, _, large = run(2, 16, overlap=True, count_ops=True)
    sizes = [b.size for b in large_sched.runner.launched if b.mode is ForwardMode.EXTEND]
    assert max(sizes) >= 16 and len(large) >= 2 and len(small) >= 2
    assert max(large) <= max(small) < 16 + 16


def test_a_failing_extend_pass_voids_the_pass_behind_it_and_its_cached_prompts() -> None:
    failed = []

    def fail_on(batch):
        if batch.mode is ForwardMode.EXTEND and not failed:
            failed.append(batch)
            return True
        return False

    runner = RecordingRunner(token_for, fail_on=fail_on)
    scheduler = make(pool=4096, chunk=64, max_reqs=8, runner=runner)
    scheduler.config.overlap_schedule = True
    states = shared_prefix_states(2, 3)
    for state in states:
        scheduler.add(state)
    while scheduler.step():
        pass
    first, second = runner.launched[:2]
    assert first is failed[0] and second.mode is ForwardMode.EXTEND
    assert runner.launches[1][1] == 1  # launched behind the failing pass
    for state in states:
        reason = state.req.finished_reason
        if state.rid in first.rids or state.rid in second.rids:
            assert reason["type"] == "abort" and "device fault" in reason["message"]
    assert scheduler.cache.cache.evictable_size() == 0  # no prompt of theirs stays cached
    scheduler.check_integrity()
    again = request(states[0].req.origin_input_ids, max_new_tokens=2)
    scheduler.add(again)
    while scheduler.step():
        pass
    assert again.req.cached_tokens == 0 and len(again.req.output_ids) == 2
    scheduler.check_integrity()


@pytest.mark.parametrize("which", ["first", "second"])
def test_abort_while_an_extend_pass_is_in_flight(which) -> None:
    runner = RecordingRunner(token_for)
    scheduler = make(pool=4096, chunk=64, max_reqs=8, runner=runner)
    scheduler.config.overlap_schedule = True
    states = shared_prefix_states(2, 3)
    for state in states:
        scheduler.add(state)
    scheduler.step()  # the first EXTEND pass, in flight
    scheduler.step()  # the second launched, the first processed
    assert scheduler.pass_in_flight
    target = next(s for s in states if s.rid in runner.launched[0 if which == "first" else 1].rids
                  and s.req.finished_reason is None)
    assert scheduler.abort(target.rid, "user abort")
    while scheduler.step():
        pass
    assert target.req.finished_reason == {"type": "abort", "message": "user abort"}
    assert all(len(s.req.output_ids) == 3 for s in states if s is not target)
    scheduler.check_integrity()
    cache = scheduler.cache
    assert cache.allocator.available() + cache.cache.evictable_size() == cache.allocator.size


def test_no_pass_is_launched_behind_one_scoring_prompt_tokens() -> None:
    """Prompt logprobs are computed when a pass's results are read: a pass launched behind it
    would run first (tensor-parallel ranks follow launches in order), so it waits."""
    runner = RecordingRunner(token_for)
    scheduler = make(pool=4096, chunk=64, max_reqs=8, runner=runner)
    scheduler.config.overlap_schedule = True
    scored = request(list(range(1000, 1040)), max_new_tokens=2)
    scored.req.return_logprob, scored.req.logprob_start_len = True, 0
    later = request(list(range(2000, 2040)), max_new_tokens=2)
    scheduler.add(scored)
    scheduler.step()  # its prefill pass, in flight
    scheduler.add(later)
    while scheduler.step():
        pass
    first, second = runner.launched[:2]
    assert first.rids == [scored.rid] and runner.launches[1][1] == 0  # after it was read
    assert second.rids == [later.rid]
    assert first.input_logprobs[0] is not None and second.input_logprobs == [None]
    scheduler.check_integrity()
