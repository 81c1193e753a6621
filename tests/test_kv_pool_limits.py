"""The KV pool at its limits: a long prompt chunk-prefilled beside a decoding request, prompts that
pinned prefixes leave no room for, failed passes whose prompts were cached at launch (the host
tier must not keep their void KV), and flushes with a pin held. Found by a review's stress
harness (tests/cache_harness.py)."""

from __future__ import annotations

from tests.test_scheduler import make, request


def test_a_chunked_prefill_beside_the_last_decoding_request_is_retracted_not_fatal() -> None:
    """A decoding request (may stop early: admitted by a reserve) and a long prompt being
    chunk-prefilled beside it; a pin taken between the chunks leaves less room than the prompt
    was admitted with, and its chunks take what the decoding request needed. The chunked
    request goes back to the queue (its chunks cached); before, the allocation raised from
    `step()` and the scheduler thread aborted every request."""
    from lmnb.runtime.pins import PrefixPins

    scheduler = make(pool=24, chunk=4)  # default conservativeness
    pinned = list(range(200, 206))
    scheduler.add(request(pinned, max_new_tokens=0))  # cached, evictable: counted as room
    while scheduler.step():
        pass
    pins = scheduler.cache.pins = PrefixPins(scheduler.cache.cache)  # counted by the checks
    a = request(list(range(10, 16)), max_new_tokens=8)  # 14 tokens at most: fits
    scheduler.add(a)
    while a.req not in scheduler.table.running:
        scheduler.step()
    b = request(list(range(100, 112)), max_new_tokens=1)  # fits beside a's reserve
    scheduler.add(b)
    scheduler.step()
    assert scheduler.table.chunked is b.req
    assert pins.pin(pinned) is not None
    for _ in range(200):
        if not scheduler.step():
            break
    assert a.req.finished_reason["type"] == b.req.finished_reason["type"] == "length"
    assert b.req.retractions >= 1


def _pinned_scheduler(pool: int, pinned: list[int]):
    from lmnb.runtime.pins import PrefixPins

    scheduler = make(pool=pool, chunk=8)
    scheduler.add(request(pinned, max_new_tokens=0))  # cache_prefix
    while scheduler.step():
        pass
    pins = scheduler.cache.pins = PrefixPins(scheduler.cache.cache)  # counted by the checks
    assert pins.pin(pinned) is not None
    return scheduler, pins


def test_a_prompt_longer_than_the_unpinned_pool_ends_with_an_error() -> None:
    """Pins hold 20 of 32 slots; a 20-token prompt arrives, is admitted alone and chunk-prefilled
    until the pool is full. It ends with an out-of-KV error and the request behind it is served
    (it used to hang there silently, and so did every request queued behind it)."""
    scheduler, _ = _pinned_scheduler(32, list(range(10, 30)))
    victim = request(list(range(40, 60)), max_new_tokens=2)  # 22 <= context (32)
    scheduler.add(victim)
    later = request([70, 71, 72], max_new_tokens=2)
    scheduler.add(later)
    for _ in range(100):
        if not scheduler.step():
            break
    assert not scheduler.has_work
    assert victim.req.finished_reason["type"] == "abort"
    assert "out of KV cache" in victim.req.finished_reason["message"]
    assert later.req.finished_reason["type"] == "length"
    scheduler.check_integrity()


def test_a_pin_taken_between_chunks_ends_the_request_it_starves() -> None:
    """The request fit when admitted (30 of 32 slots; the 10 cached tokens were evictable); a pin
    of those 10 tokens taken between its chunks leaves it 2 tokens short: it ends with an error
    instead of waiting forever."""
    from lmnb.runtime.pins import PrefixPins

    scheduler = make(pool=32, chunk=8)
    cached = list(range(10, 20))
    scheduler.add(request(cached, max_new_tokens=0))
    while scheduler.step():
        pass
    big = request(list(range(40, 70)), max_new_tokens=1)
    scheduler.add(big)
    assert scheduler.step()  # first chunk
    assert scheduler.table.chunked is big.req
    pins = scheduler.cache.pins = PrefixPins(scheduler.cache.cache)  # counted by the checks
    assert pins.pin(cached) is not None
    for _ in range(100):
        if not scheduler.step():
            break
    assert big.req.finished_reason["type"] == "abort"  # it used to stall here for good
    assert "out of KV cache" in big.req.finished_reason["message"]
    assert not scheduler.has_work


def test_a_failed_overlapped_prefill_leaves_no_void_kv_in_the_host_tier() -> None:
    """Overlap schedule (the CUDA default) over the tiered cache: a prefill pass's prompt is
    cached at launch; the pass fails and its never-written KV is dropped, not saved to the host
    pool (eviction saves; `drop_unlocked` does not), so the next request with that prefix
    computes it (the runner checks every prefix row it reads)."""
    import logging

    from lmnb.runtime.core import Req, SamplingParams
    from lmnb.runtime.scheduler import ReqState
    from tests.cache_harness import World

    logging.disable(logging.CRITICAL)
    try:
        world = World(0, tiered=True, overlap=True, pool=48, host=40)

        def add(ids):
            req = Req(origin_input_ids=ids, sampling_params=SamplingParams(max_new_tokens=2))
            world.reqs[req.rid] = req
            state = ReqState(req)
            world.states.append(state)
            world.scheduler.add(state)
            return state

        prompt = list(range(10, 30))
        first = add(prompt)
        world.runner.fail_rate = 1.0
        world.step()  # launched
        world.step()  # its result: the device failed
        world.runner.fail_rate = 0.0
        assert first.req.finished_reason["type"] == "abort"
        assert world.cache.stats()["hicache_host_only_tokens"] == 0, "void KV kept on the host"
        add(prompt + [5, 6])
        world.drain()  # the runner asserts the KV of every prefix it reads
    finally:
        logging.disable(logging.NOTSET)


def test_a_voided_following_prefill_drops_its_prompt_when_a_decode_pass_fails() -> None:
    """Overlap schedule, plain RadixCache: a decode pass is in flight, the next pass launched
    behind it is a prefill (its prompt is inserted into the cache at launch). The decode pass
    fails: the scheduler voids the following pass too (it read this one's tokens or KV), ends
    its requests, and drops the prompts it cached at launch: their KV was never (validly)
    computed."""
    import logging

    from lmnb.runtime.core import Req, SamplingParams
    from lmnb.runtime.scheduler import ReqState
    from tests.cache_harness import World

    logging.disable(logging.CRITICAL)
    try:
        world = World(0, tiered=False, overlap=True, pool=64)
        world.runner.rng.random = lambda: 0.5  # no EOS

        def add(ids, n=6):
            req = Req(origin_input_ids=ids, sampling_params=SamplingParams(max_new_tokens=n))
            world.reqs[req.rid] = req
            state = ReqState(req)
            world.states.append(state)
            world.scheduler.add(state)
            return state

        add(list(range(10, 20)))
        world.step()  # its prefill launched
        world.runner.fail_rate = 1.0  # the device fails from here
        world.step()  # its first decode launched (fails), the prefill processed
        second = add(list(range(30, 45)))
        world.step()  # the second prompt's prefill launched behind it, then the decode fails
        world.runner.fail_rate = 0.0
        assert second.req.finished_reason["type"] == "abort"
        assert world.cache.cached_length(list(range(30, 45))) == 0, \
            "the voided pass's prompt is still cached"
    finally:
        logging.disable(logging.NOTSET)


def test_flush_with_a_pin_keeps_nothing_else_in_the_host_tier() -> None:
    """`Runtime.flush_cache`'s body (replayed by `World.flush`) with a pin held and the host
    tier on: only the pinned prefix stays; the unpinned prompt is neither on the device nor in
    host memory (eviction would have saved it there)."""
    from tests.cache_harness import World

    world = World(0, tiered=True, pool=64, host=64)
    from lmnb.runtime.core import Req, SamplingParams
    from lmnb.runtime.scheduler import ReqState

    for ids in (list(range(10, 20)), list(range(30, 45))):
        req = Req(origin_input_ids=ids, sampling_params=SamplingParams(max_new_tokens=0))
        world.reqs[req.rid] = req
        world.scheduler.add(ReqState(req))
        world.drain()
    assert world.pins.pin(list(range(10, 20))) is not None
    assert world.flush()
    unpinned = list(range(30, 45)) + [1]
    match = world.cache.match_prefix(unpinned)
    assert match.length + match.host_length == 0, \
        f"flushed prompt still cached: {match.length} on device, {match.host_length} on host"
