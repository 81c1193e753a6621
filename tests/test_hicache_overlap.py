"""Overlapped hierarchical-cache loads and disk read-ahead, on the CPU path (the CUDA path runs
the same bookkeeping with streams and events: tests/gpu/test_hicache_overlap_cuda.py):

- a queued host -> device load is copied layer by layer only when a reader asks for the layer
  (`KVStorage.ready`), so a reader that skipped it would see rows not yet loaded;
- a request that ends while its prefix's load is still queued leaves every slot accounted for;
- a request whose prefix fails to load back is ended with that error, unbound, the others run;
- a prefix kept in host memory counts as cached when a request sharing it might wait for another;
- a request refused for room loads nothing (the copies and the device rows they take would be
  spent on a request that does not run); once it fits, its whole host-resident prefix comes back;
- a request whose disk pages are being read waits in the queue while others run; an otherwise
  idle scheduler waits for the read; the pages then count as cache hits.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from lmnb.runtime.core import Req, SamplingParams, StepOutput
from lmnb.runtime.hicache.disk import DiskTier
from lmnb.runtime.hicache.host_pool import HostKVPool
from lmnb.runtime.memory import KVAllocator, KVStorage, ReqToTokenPool
from lmnb.runtime.policy import make_policy
from lmnb.runtime.radix.tiered import TieredRadixCache
from lmnb.runtime.scheduler import CacheManager, ReqState, Scheduler, SchedulerConfig, StopRules

CPU = torch.device("cpu")
PAGE = 4


def _storage(size: int = 64, layers: int = 3) -> KVStorage:
    kv = KVStorage(size, num_layers=layers, kv_heads=1, head_dim=2, dtype=torch.float32,
                   device=CPU)
    for layer in range(layers):
        kv.k_buffers[layer].zero_()
        kv.v_buffers[layer].zero_()
    return kv


def test_loads_are_copied_layer_by_layer_when_read() -> None:
    kv = _storage()
    pool = HostKVPool(16, kv)
    source = torch.arange(1, 6)
    for layer in range(kv.num_layers):
        rows = torch.arange(10.0 * layer, 10.0 * layer + 10).view(5, 1, 2)
        kv.set_kv(layer, source, rows, -rows)
    host = pool.allocator.alloc(5)
    pool.save(source, host)
    target = torch.tensor([20, 21, 30, 31, 32])
    pool.load(host, target)
    assert kv.pending is pool.loads and pool.loads.busy
    assert not kv.k_buffers[0][target].any()  # queued: nothing copied yet
    kv.ready(1)
    assert torch.equal(kv.k_buffers[1][target], kv.k_buffers[1][source])
    assert torch.equal(kv.v_buffers[1][target], kv.v_buffers[1][source])
    assert not kv.k_buffers[0][target].any() and not kv.k_buffers[2][target].any()
    kv.ready(0)
    kv.ready(2)
    assert kv.pending is None and not pool.loads.busy
    for layer in range(kv.num_layers):
        assert torch.equal(kv.k_buffers[layer][target], kv.k_buffers[layer][source])
        assert torch.equal(kv.v_buffers[layer][target], kv.v_buffers[layer][source])
    counters = pool.loads.read_counters()
    assert (counters.loads, counters.tokens) == (1, 5)


def test_a_save_reusing_host_rows_lets_queued_loads_read_them_first() -> None:
    kv = _storage()
    pool = HostKVPool(4, kv)
    first, second = torch.arange(1, 5), torch.arange(5, 9)
    for layer in range(kv.num_layers):
        kv.set_kv(layer, first, torch.full((4, 1, 2), 1.0), torch.full((4, 1, 2), 1.0))
        kv.set_kv(layer, second, torch.full((4, 1, 2), 2.0), torch.full((4, 1, 2), 2.0))
    host = pool.allocator.alloc(4)
    pool.save(first, host)
    target = torch.arange(40, 44)
    pool.load(host, target)  # queued
    pool.allocator.free(host)
    pool.save(second, pool.allocator.alloc(4))  # the same host rows, overwritten
    kv.ready(0)
    assert (kv.k_buffers[0][target] == 1.0).all()  # the load read the rows before the save


class FailingOnce:
    """A runner that fails the `fail_at`-th pass (the pass reads no KV: a load queued for it is
    never waited for) and samples 100 otherwise; with `kv` it writes each new token's KV as its
    token id (+ layer)."""

    def __init__(self, fail_at: int | None = None, kv: KVStorage | None = None) -> None:
        self.passes = 0
        self.fail_at = fail_at
        self.kv = kv
        self.batches = []

    def run(self, batch, rows):
        self.passes += 1
        self.batches.append(batch)
        if self.passes == self.fail_at:
            raise RuntimeError("the device failed")
        if self.kv is not None:
            ids = torch.tensor(batch.input_ids, dtype=torch.float32).view(-1, 1, 1)
            for layer in range(self.kv.num_layers):
                self.kv.k_buffers[layer][batch.out_cache_loc] = ids + layer
                self.kv.v_buffers[layer][batch.out_cache_loc] = -ids - layer
        out = StepOutput.empty(batch.size)
        for i, samples in enumerate(batch.samples):
            if samples:
                out.next_token_ids[i] = 100
        return out


class Sink:
    def put(self, events) -> None:
        pass


def _scheduler(cache: TieredRadixCache, runner) -> Scheduler:
    manager = CacheManager(cache, cache.allocator, ReqToTokenPool(4, 256, CPU))
    return Scheduler(runner=runner, cache=manager, policy=make_policy("fcfs"),
                     config=SchedulerConfig(chunked_prefill_size=64,
                                            check_integrity_each_step=True),
                     stop_rules=StopRules({2}), sink=Sink())


def _request(prompt: list[int]) -> ReqState:
    return ReqState(Req(origin_input_ids=list(prompt),
                        sampling_params=SamplingParams(max_new_tokens=1)))


def _run(scheduler: Scheduler) -> None:
    for _ in range(100):
        if not scheduler.step():
            return
    raise AssertionError("the scheduler did not finish")


def _assert_rows(kv: KVStorage, slots: torch.Tensor, tokens: list[int]) -> None:
    """Rows `slots` hold the KV `FailingOnce` wrote for `tokens` (read as attention does)."""
    ids = torch.tensor(tokens, dtype=torch.float32)
    for layer in range(kv.num_layers):
        kv.ready(layer)
        assert torch.equal(kv.k_buffers[layer][slots][:, 0, 0], ids + layer)
        assert torch.equal(kv.v_buffers[layer][slots][:, 0, 1], -ids - layer)


@dataclass
class _HostPrefix:
    """A scheduler over a write-through tiered cache whose 30-token `prefix` was computed, then
    pushed out of device memory by a later prompt (its host copy kept)."""

    kv: KVStorage
    cache: TieredRadixCache
    runner: FailingOnce
    scheduler: Scheduler
    prefix: list[int]


def _prefix_in_host_memory(*, device: int, host: int, pusher: list[int]) -> _HostPrefix:
    kv = _storage(size=device)
    cache = TieredRadixCache(KVAllocator(device, CPU), HostKVPool(host, kv), write_through=True)
    runner = FailingOnce(kv=kv)
    scheduler = _scheduler(cache, runner)
    prefix = list(range(10, 40))
    for prompt in (prefix + [1], pusher):  # the second pushes the first out
        scheduler.add(_request(prompt))
        _run(scheduler)
    return _HostPrefix(kv, cache, runner, scheduler, prefix)


def test_request_ended_with_its_load_queued_frees_everything() -> None:
    kv = _storage(size=48)
    allocator = KVAllocator(48, CPU)
    cache = TieredRadixCache(allocator, HostKVPool(96, kv), write_through=True)
    runner = FailingOnce(fail_at=3, kv=kv)
    scheduler = _scheduler(cache, runner)
    prefix = list(range(10, 40))
    for prompt in (prefix + [1], list(range(50, 90))):  # the second pushes the first out
        scheduler.add(_request(prompt))
        _run(scheduler)
    assert cache.cached_length(prefix) == 30 and cache.match_prefix(prefix + [1]).length < 30
    doomed = _request(prefix + [2, 3])
    scheduler.add(doomed)
    _run(scheduler)  # its prefix is loaded back (queued), then its pass fails
    assert doomed.req.finished_reason["type"] == "abort"
    assert cache.host_loaded_tokens >= 30 and cache.host_pool.loads.busy
    scheduler.check_integrity()
    _assert_rows(kv, cache.match_prefix(prefix + [9]).indices, prefix)
    assert cache.evict(48) > 0  # the loaded rows are freed: the load is settled first
    assert not cache.host_pool.loads.busy
    assert allocator.available() == 48
    scheduler.check_integrity()
    again = _request(prefix + [4])
    scheduler.add(again)
    _run(scheduler)
    assert again.req.cached_tokens == 30
    scheduler.check_integrity()


def test_a_refused_request_loads_nothing_until_it_fits() -> None:
    setup = _prefix_in_host_memory(device=48, host=192, pusher=list(range(50, 90)))
    kv, cache, scheduler, prefix = setup.kv, setup.cache, setup.scheduler, setup.prefix
    assert cache.match_prefix(prefix + [2]).length < 30 and cache.cached_length(prefix) == 30
    loaded = cache.host_loaded_tokens
    long = _request(list(range(200, 208)))
    long.req.sampling_params.max_new_tokens = 30  # its reserve leaves no room for 31 tokens
    scheduler.add(long)
    scheduler.step()  # its prefill
    waiting = _request(prefix + [2])
    scheduler.add(waiting)
    scheduler.step()  # a decode pass of `long`; `waiting` does not fit
    assert not waiting.req.admitted and long.req.output_ids
    assert cache.host_loaded_tokens == loaded and not cache.host_pool.loads.busy
    assert cache.host_pool.loads.counters.tokens == loaded
    scheduler.check_integrity()
    _run(scheduler)
    assert len(long.req.output_ids) == 30
    assert waiting.req.cached_tokens == 30  # its whole prefix, loaded once it fitted
    assert cache.host_loaded_tokens == loaded + 30
    _assert_rows(kv, cache.match_prefix(prefix + [3]).indices, prefix)
    scheduler.check_integrity()


def test_a_failed_load_back_ends_its_request_and_frees_its_binding(monkeypatch) -> None:
    setup = _prefix_in_host_memory(device=48, host=96, pusher=list(range(50, 90)))
    kv, cache, scheduler, prefix = setup.kv, setup.cache, setup.scheduler, setup.prefix
    assert cache.match_prefix(prefix + [2]).length < 30 and cache.cached_length(prefix) == 30
    load = cache.host_pool.load

    def broken(host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        raise RuntimeError("host copy failed")

    monkeypatch.setattr(cache.host_pool, "load", broken)
    doomed, other = _request(prefix + [2]), _request([7, 8, 9])
    scheduler.add(doomed)
    scheduler.add(other)
    _run(scheduler)
    assert doomed.req.finished_reason["type"] == "abort"
    assert "loading its cached prefix back failed" in doomed.req.finished_reason["message"]
    assert "host copy failed" in doomed.req.finished_reason["message"]
    assert other.req.output_ids == [100]  # the rest of the queue runs
    scheduler.check_integrity()
    monkeypatch.setattr(cache.host_pool, "load", load)
    again = _request(prefix + [3])
    scheduler.add(again)
    _run(scheduler)
    assert again.req.cached_tokens == 30  # the host copy was kept
    _assert_rows(kv, cache.match_prefix(prefix + [4]).indices, prefix)
    scheduler.check_integrity()


def test_a_prefix_in_host_memory_counts_as_cached_when_deferring_shared_prompts() -> None:
    """B's prompt shares with A's (admitted before it, computing its whole prompt) just the part
    B can load back from host memory: B runs in A's pass instead of waiting for A's KV."""
    setup = _prefix_in_host_memory(device=96, host=256, pusher=list(range(100, 190)))
    kv, cache, runner, scheduler, prefix = (setup.kv, setup.cache, setup.runner, setup.scheduler,
                                            setup.prefix)
    match = cache.match_prefix(prefix + [2])
    assert match.length == 0 and match.host_length == 30
    first = _request(prefix + [1, 2])
    first.req.return_logprob, first.req.logprob_start_len = True, 0  # scores all: loads nothing
    second = _request(prefix + [5])
    scheduler.add(first)
    scheduler.add(second)
    scheduler.step()
    assert runner.batches[-1].rids == [first.req.rid, second.req.rid]
    _run(scheduler)
    assert second.req.cached_tokens == 30 and first.req.cached_tokens == 0
    assert second.req.output_ids == [100]
    _assert_rows(kv, cache.match_prefix(prefix + [9]).indices, prefix)
    scheduler.check_integrity()


def _disk_cache(root: Path, pool: int = 256) -> tuple[TieredRadixCache, DiskTier]:
    kv = _storage(size=pool)
    disk = DiskTier(root, "model", kv, max_bytes=1 << 22, page_tokens=PAGE)
    return TieredRadixCache(KVAllocator(pool, CPU), HostKVPool(pool, kv), write_through=True,
                            disk=disk), disk


class GatedDisk:
    """Holds every disk read until `gate` is set."""

    def __init__(self, disk: DiskTier) -> None:
        self.gate = threading.Event()
        self.load = disk.load
        disk.load = self  # type: ignore[method-assign]

    def __call__(self, *args, **kwargs):
        assert self.gate.wait(timeout=60)
        return self.load(*args, **kwargs)


def test_a_request_whose_pages_are_read_waits_while_others_run(tmp_path: Path) -> None:
    prefix = list(range(100, 120))  # 5 pages
    cache, disk = _disk_cache(tmp_path)
    scheduler = _scheduler(cache, FailingOnce())
    scheduler.add(_request(prefix + [1]))
    _run(scheduler)
    cache.close()  # the pages are on disk; a new "process" follows
    assert disk.written_pages == 5

    cache, disk = _disk_cache(tmp_path)
    gated = GatedDisk(disk)
    runner = FailingOnce()
    scheduler = _scheduler(cache, runner)
    warm, other = _request(prefix + [2, 3]), _request(list(range(300, 310)))
    scheduler.add(warm)
    scheduler.add(other)
    assert scheduler.step()
    assert runner.batches[0].rids == [other.rid]  # the warm one waits for its pages
    assert other.req.finished_reason is not None and warm.req.req_pool_idx is None
    timer = threading.Timer(0.01, gated.gate.set)  # either order: the scheduler waits for it
    timer.start()
    _run(scheduler)  # only the warm one is left: the idle scheduler waits for its read
    timer.join()
    assert [batch.rids for batch in runner.batches] == [[other.rid], [warm.rid]]
    assert warm.req.finished_reason["type"] == "length"
    assert warm.req.cached_tokens == 20 and cache.disk_loaded_tokens == 20
    stats = cache.stats()
    assert stats["hicache_prefetch_reads"] == 1 and stats["hicache_loads"] == 1
    scheduler.check_integrity()
    cache.close()


class FakeStream:
    """Stands in for a CUDA stream on the CPU: work runs at once; waits are recorded."""

    def __init__(self) -> None:
        self.waits = 0

    def wait_stream(self, other) -> None:
        self.waits += 1

    def wait_event(self, event) -> None:
        self.waits += 1


class FakeEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        self.recorded = False

    def record(self, stream=None) -> None:
        self.recorded = True

    def query(self) -> bool:
        return self.recorded

    def synchronize(self) -> None:
        assert self.recorded

    def elapsed_time(self, other: FakeEvent) -> float:
        assert self.recorded and other.recorded
        return 1.0


def test_the_stream_path_keeps_its_books(monkeypatch) -> None:
    """The CUDA branches (streams and events faked, copies at once) through a scheduler whose
    pass fails with its load in flight, then succeeds: the same slots and data as the CPU path."""
    import contextlib

    compute = FakeStream()
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None, raising=False)
    kv = _storage(size=48)
    pool = HostKVPool(96, kv)
    pool.loads.stream, pool._stream = FakeStream(), FakeStream()
    allocator = KVAllocator(48, CPU)
    cache = TieredRadixCache(allocator, pool, write_through=True)
    scheduler = _scheduler(cache, FailingOnce(fail_at=3, kv=kv))
    prefix = list(range(10, 40))
    for prompt in (prefix + [1], list(range(50, 90)), prefix + [2, 3]):
        scheduler.add(_request(prompt))
        _run(scheduler)
    assert pool.loads.busy and kv.pending is pool.loads
    scheduler.check_integrity()
    match = cache.match_prefix(prefix + [9])
    assert match.length == 30
    _assert_rows(kv, match.indices, prefix)
    assert kv.pending is None and compute.waits >= kv.num_layers
    counters = pool.loads.read_counters()
    assert counters.loads == 1 and counters.load_seconds > 0 and counters.waited_seconds > 0
    assert cache.evict(48) == 30 and allocator.available() == 48
    scheduler.check_integrity()
    pool.release()
