"""Random workloads stepped by hand: requests arriving between steps, early stops by EOS, length
limits, aborts at any moment (also while their prefill pass is in flight, and of requests that
just ended), small pools (retractions), with and without the overlap schedule; KV slots and
request rows are conserved at every step and everything ends."""

from __future__ import annotations

import random

import pytest

from tests.test_overlap_schedule import PipelinedFakeRunner
from tests.test_scheduler import EOS, FakeRunner, make, request


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("overlap", [False, True])
def test_random_workloads_conserve_kv_and_end(seed: int, overlap: bool) -> None:
    rng = random.Random(seed)
    stop_after: dict[int, int] = {}  # a prompt's first id -> outputs before it samples EOS

    def token_for(row):
        n = len(row.output_ids)
        return EOS if n == stop_after.get(row.origin_input_ids[0], -1) else 100 + n % 7

    runner = PipelinedFakeRunner(token_for) if overlap else FakeRunner(token_for)
    scheduler = make(pool=rng.choice([48, 64, 128, 256]), chunk=rng.choice([8, 16, 64]),
                     runner=runner, max_reqs=8, exact_length_admission=seed % 2 == 0,
                     conservativeness=rng.choice([0.1, 0.3, 1.0]))
    scheduler.config.overlap_schedule = overlap
    states = []
    for _ in range(300):
        if rng.random() < 0.3 and len(states) < 40:
            first = rng.randrange(1, 6) * 10 + len(states) % 3
            stop_after[first] = rng.randrange(0, 12)
            prompt = [first] + [rng.randrange(3, 9) for _ in range(rng.randrange(1, 12))]
            state = request(prompt, max_new_tokens=rng.randrange(1, 15))
            states.append(state)
            scheduler.add(state)
        if states and rng.random() < 0.1:
            scheduler.abort(rng.choice(states).rid)
        scheduler.step()
        scheduler.check_integrity()
    while scheduler.step():
        scheduler.check_integrity()
    for state in states:
        assert state.req.finished_reason is not None and state.req.req_pool_idx is None
    cache = scheduler.cache
    assert cache.allocator.available() + cache.cache.evictable_size() == cache.allocator.size
