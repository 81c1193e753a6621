"""Seeded stress of the scheduler over the (tiered) radix cache (`tests/cache_harness.py`): random
prompts sharing prefixes, aborts, pins, flushes, tiny pools, with and without the overlap schedule
and the host tier; after every operation every slot is in exactly one place, every node's lock
count equals its holders, and every prefix row a pass reads holds that prefix's KV."""

from __future__ import annotations

import pytest

from tests.cache_harness import random_run

CONFIGS = [dict(tiered=False), dict(tiered=False, overlap=True), dict(tiered=True),
           dict(tiered=True, overlap=True), dict(tiered=True, write_through=True, overlap=True),
           dict(tiered=True, pool=32, max_new=20, host=24),
           dict(tiered=True, host=12, overlap=True, max_new=14, chunk=8)]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("config", range(len(CONFIGS)))
def test_random_cache_workloads(seed: int, config: int) -> None:
    random_run(seed, **CONFIGS[config])
