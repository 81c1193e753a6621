"""RadixAttention inside the runtime: hits change nothing but speed; policies order as promised."""

from __future__ import annotations

import random

import pytest
import torch

from lmnb.runtime.core import Req, SamplingParams
from lmnb.runtime.engine import Runtime
from lmnb.runtime.memory import KVAllocator
from lmnb.runtime.policy import make_policy
from lmnb.runtime.radix.cache import RadixCache

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def folder(tiny_models):
    return tiny_models["llama-gqa"]


@pytest.fixture(scope="module")
def reference(folder):
    with Runtime(folder, disable_radix_cache=True, max_total_tokens=4096) as rt:
        yield rt


def _expected(reference: Runtime, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    outs = reference.generate(input_ids=prompts,
                              sampling_params={"max_new_tokens": new_tokens, **GREEDY})
    return [out["output_ids"] for out in outs]


def _family(seed: int, count: int) -> list[list[int]]:
    """Prompts that share prefixes of many lengths: hits end mid-edge and at node boundaries."""
    rng = random.Random(seed)
    trunk = [rng.randrange(3, 49000) for _ in range(60)]
    prompts = []
    for _ in range(count):
        cut = rng.randint(1, len(trunk))
        prompts.append(trunk[:cut] + [rng.randrange(3, 49000) for _ in range(rng.randint(1, 12))])
    return prompts


def test_cache_hits_give_the_same_tokens(folder, reference):
    prompts = _family(0, 12)
    expected = _expected(reference, prompts, 10)
    with Runtime(folder, max_total_tokens=4096, check_integrity_each_step=True) as rt:
        first = [rt.generate(input_ids=p, sampling_params={"max_new_tokens": 10, **GREEDY})
                 for p in prompts]  # one by one: later prompts hit earlier ones mid-edge
        assert [out["output_ids"] for out in first] == expected
        assert sum(out["meta_info"]["cached_tokens"] for out in first) > 0
        again = rt.generate(input_ids=prompts, sampling_params={"max_new_tokens": 10, **GREEDY})
        assert [out["output_ids"] for out in again] == expected
        assert all(out["meta_info"]["cached_tokens"] == len(p) - 1
                   for out, p in zip(again, prompts, strict=True))
        stats = rt.stats()
        assert 0 < stats["cache_hit_rate"] <= 1
        assert stats["tree_nodes"] > len(prompts)
        rt.check_integrity()


def test_hits_after_evictions_in_a_small_pool(folder, reference):
    prompts = _family(1, 24)
    expected = _expected(reference, prompts, 12)
    with Runtime(folder, max_total_tokens=200, chunked_prefill_size=32,
                 check_integrity_each_step=True) as rt:
        outs = [rt.generate(input_ids=p, sampling_params={"max_new_tokens": 12, **GREEDY})
                for p in prompts]
        assert [out["output_ids"] for out in outs] == expected
        batched = rt.generate(input_ids=prompts, sampling_params={"max_new_tokens": 12, **GREEDY})
        assert [out["output_ids"] for out in batched] == expected
        stats = rt.stats()
        assert stats["evicted_tokens"] > 0
        assert stats["cached_tokens"] > 0
        rt.check_integrity()


def test_prompt_logprobs_are_computed_even_when_cached(folder, reference):
    prompt = _family(2, 1)[0]
    kwargs = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}
    want = reference.generate(input_ids=prompt, sampling_params={"max_new_tokens": 3, **GREEDY},
                              **kwargs)
    with Runtime(folder, max_total_tokens=2048) as rt:
        rt.cache_prefix(input_ids=prompt + [5])
        got = rt.generate(input_ids=prompt, sampling_params={"max_new_tokens": 3, **GREEDY},
                          **kwargs)
    assert got["output_ids"] == want["output_ids"]
    got_lp = got["meta_info"]["input_token_logprobs"]
    want_lp = want["meta_info"]["input_token_logprobs"]
    assert len(got_lp) == len(prompt)
    assert got_lp[0] == (None, prompt[0])
    for (a, ta), (b, tb) in zip(got_lp[1:], want_lp[1:], strict=True):
        assert ta == tb and abs(a - b) < 1e-4


def test_cache_prefix_is_hit_by_the_next_request(folder):
    with Runtime(folder, max_total_tokens=2048, check_integrity_each_step=True) as rt:
        prefix = list(range(1000, 1050))
        assert rt.cache_prefix(input_ids=prefix) == 50
        out = rt.generate(input_ids=prefix + [7, 8, 9], sampling_params={"max_new_tokens": 2})
        assert out["meta_info"]["cached_tokens"] == 50  # a prefill-only request caches all
        assert rt.flush_cache()
        assert rt.stats()["tree_tokens"] == 0
        out = rt.generate(input_ids=prefix + [7, 8, 9], sampling_params={"max_new_tokens": 2})
        assert out["meta_info"]["cached_tokens"] == 0
        rt.check_integrity()


def test_waiting_requests_sharing_a_new_prefix_hit_the_first_ones_prefill(folder):
    shared = list(range(2000, 2080))
    prompts = [shared + [i] for i in range(6)]
    with Runtime(folder, max_total_tokens=2048) as rt:
        outs = rt.generate(input_ids=prompts, sampling_params={"max_new_tokens": 2})
    cached = sorted(out["meta_info"]["cached_tokens"] for out in outs)
    assert cached == [0] + [80] * 5


def test_disabled_cache_reports_no_hits(folder, reference):
    prompts = [list(range(3000, 3040)) + [i] for i in range(3)]
    outs = reference.generate(input_ids=prompts * 2, sampling_params={"max_new_tokens": 1})
    assert all(out["meta_info"]["cached_tokens"] == 0 for out in outs)


# ---- policies ---------------------------------------------------------------------------------

def _cache_with(keys: list[list[int]]) -> RadixCache:
    pool = KVAllocator(256, torch.device("cpu"))
    cache = RadixCache(pool)
    for key in keys:
        cache.insert(key, pool.alloc(len(key)))
    return cache


def _req(ids: list[int], arrival: int = 0) -> Req:
    req = Req(origin_input_ids=ids, sampling_params=SamplingParams())
    req.arrival_pass = arrival
    return req


def test_lpm_orders_by_longest_cached_prefix():
    cache = _cache_with([[1, 2, 3, 4, 5, 6], [9, 9]])
    short, none, long = _req([1, 2, 7, 7]), _req([5, 5, 5]), _req([1, 2, 3, 4, 5, 8])
    assert make_policy("lpm").order([short, none, long], cache, 0) == [long, short, none]
    assert make_policy("fcfs").order([short, none, long], cache, 0) == [short, none, long]


def test_dfs_weight_groups_requests_of_a_subtree_heaviest_first():
    cache = _cache_with([[1, 1, 1, 1], [2, 2, 2, 2]])
    a1, b1, a2, b2, a3 = (_req([1, 1, 1, 1, 5]), _req([2, 2, 2, 2, 5]), _req([1, 1, 1, 1, 6]),
                          _req([2, 2, 2, 2, 6]), _req([1, 1, 1, 1, 7]))
    order = make_policy("dfs-weight").order([a1, b1, a2, b2, a3], cache, 0)
    assert order[:3] == [a1, a2, a3] and order[3:] == [b1, b2]


def test_dfs_weight_puts_a_nodes_own_requests_after_its_subtrees():
    """As SGLang's `_get_dfs_priority` (post-order): deeper hits first, requests that match
    nothing cached last."""
    cache = _cache_with([[1, 1, 1, 1, 2, 2]])
    none, shallow, deep = _req([9, 9, 9]), _req([1, 1, 1, 1, 5]), _req([1, 1, 1, 1, 2, 2, 7])
    order = make_policy("dfs-weight").order([none, shallow, deep], cache, 0)
    assert order == [deep, shallow, none]


def test_lpm_fair_bounds_waiting():
    cache = _cache_with([[1, 2, 3, 4, 5, 6]])
    old = _req([9, 9, 9], arrival=0)
    hit = _req([1, 2, 3, 4, 5, 7], arrival=90)
    policy = make_policy("lpm-fair")
    assert policy.order([old, hit], cache, clock=10) == [hit, old]  # young: plain LPM
    assert policy.order([old, hit], cache, clock=100) == [old, hit]  # starving: goes first
