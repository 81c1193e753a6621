"""`Runtime.stats()` is the collaborators' own reports merged: each one on its own here, with a
scheduler stepped by hand (no model, no thread); the merged dict is checked live in
test_runtime_api.py and test_radix_runtime.py."""

from __future__ import annotations

import torch

from lmnb.runtime.memory import KVAllocator
from lmnb.runtime.pins import PrefixPins
from lmnb.runtime.prefix_cache import NoReuseCache
from lmnb.runtime.radix.cache import RadixCache
from tests.test_scheduler import make, request, run_to_end

CPU = torch.device("cpu")
CACHE_KEYS = {"evicted_tokens", "eviction_events", "tree_nodes", "tree_tokens",
              "evictable_tokens", "protected_tokens"}


def test_scheduler_cache_allocator_and_pins_report_their_parts() -> None:
    scheduler = make(pool=64)
    cache = scheduler.cache.cache
    for prompt in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9]):  # the second finds 3 tokens cached
        scheduler.add(request(prompt, max_new_tokens=3))
        run_to_end(scheduler)
    report = scheduler.report()
    assert (report["running"], report["waiting"], report["overlap_schedule"]) == (0, 0, False)
    assert report["prompt_tokens"] == 11 and report["cached_tokens"] == 3
    stats = cache.stats()
    assert set(stats) == CACHE_KEYS and stats["tree_nodes"] == cache.node_count() >= 3
    assert stats["tree_tokens"] == stats["evictable_tokens"] == cache.evictable_size() > 0
    allocator = scheduler.cache.allocator
    assert allocator.stats() == {"max_total_tokens": 64, "free_tokens": allocator.available()}
    pins = PrefixPins(cache)
    assert pins.pin([1, 2, 3, 4, 5, 6]) is not None
    assert pins.stats() == {"pinned_prefixes": 1, "pinned_tokens": 6}
    assert cache.stats()["protected_tokens"] == 6
    freed = cache.evict(64)
    after = cache.stats()
    assert after["evicted_tokens"] == freed > 0 and after["eviction_events"] >= 1


def test_a_cache_without_reuse_reports_zeros_and_no_tree() -> None:
    cache = NoReuseCache(KVAllocator(8, CPU))
    assert cache.stats() == dict.fromkeys(CACHE_KEYS, 0)
    assert cache.snapshot() == [] and RadixCache(KVAllocator(8, CPU)).snapshot() != []
