"""Shared-prefix (cascade) decode attention: a group's prefix read once per tile gives the same
output as every request reading its whole KV row (interpreted on CPU, compiled on CUDA)."""

from __future__ import annotations

import random

import pytest
import torch

# tests.triton_modes sets TRITON_INTERPRET: it is imported before any kernel module.
from tests.triton_modes import DEVICES, SAME_TRITON_MODE

# isort: split
from lmnb.runtime.kernels.shared_prefix import (
    BLOCK_M,
    PART_MIN_TOKENS,
    PREFIX_SPLITS,
    SMALL_TILE_ROWS,
    TILE_HEIGHTS,
    SharedPrefixes,
    members_per_tile,
    plan_items,
    tile_rows_for,
)
from lmnb.runtime.kernels.triton_decode import decode_attention, decode_config, partial_buffers

pytestmark = SAME_TRITON_MODE

TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _rows(device: str, gen: torch.Generator, rng: random.Random, groups: list[tuple[int, int]],
          loners: int, num_slots: int) -> tuple[list[list[int]], list[tuple[int, list[int]]]]:
    """KV rows (slot lists) of requests in `groups` = (prefix length, members) sharing their
    prefix's slots, then `loners` requests of their own; returns rows and (prefix, row ids)."""
    free = (torch.randperm(num_slots, generator=gen) + 1).tolist()
    rows: list[list[int]] = []
    plan: list[tuple[int, list[int]]] = []
    for prefix_len, members in groups:
        prefix = [free.pop() for _ in range(prefix_len)]
        ids = []
        for _ in range(members):
            ids.append(len(rows))
            rows.append(prefix + [free.pop() for _ in range(rng.randint(1, 40))])
        plan.append((prefix_len, ids))
    for _ in range(loners):
        rows.append([free.pop() for _ in range(rng.randint(1, 90))])
    order = list(range(len(rows)))
    rng.shuffle(order)  # group members are not adjacent in the batch
    where = {old: new for new, old in enumerate(order)}
    return [rows[i] for i in order], [(p, [where[i] for i in ids]) for p, ids in plan]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "dtype"), [
    (8, 2, 64, torch.float32), (2, 2, 32, torch.bfloat16)])  # GQA 4, MHA
@pytest.mark.parametrize(("suffix_splits", "rows"), [
    (3, 64), (1, 64),  # a busy batch's grid: one split a suffix
    (3, 16), (3, 32)])  # shorter tiles (GQA 4: 4 and 8 members; MHA: 16 and 32)
def test_shared_prefix_decode_equals_plain_decode(device, heads, kv_heads, head_dim, dtype,
                                                  suffix_splits, rows):
    if device == "cpu" and heads == kv_heads and rows > 16:
        pytest.skip("MHA tiles of 32-64 members are slow in the interpreter: compiled only")
    rng, gen = random.Random(heads), torch.Generator().manual_seed(head_dim)
    members = members_per_tile(heads, kv_heads, rows)
    # A group larger than one tile, a small one, a prefix under one split, and loners.
    # Parts of PART_MIN_TOKENS: the long prefix is cut in two.
    groups = [(2 * PART_MIN_TOKENS + 30, members + 3), (70, 2), (5, 3)]
    rows, plan = _rows(device, gen, rng, groups, loners=3, num_slots=5000)
    bs = len(rows)
    kv_indptr = torch.tensor([0, *map(len, rows)], device=device).cumsum(0)
    kv_indices = torch.tensor([s for row in rows for s in row], device=device)
    shape = (5001, kv_heads, head_dim)
    k_buffer, v_buffer = (torch.randn(shape, generator=gen).to(device, dtype) for _ in range(2))
    q = torch.randn(bs, heads, head_dim, generator=gen).to(device, dtype)
    splits = 3

    expected = torch.empty_like(q)
    decode_attention(q, k_buffer, v_buffer, expected, kv_indptr, kv_indices,
                     *partial_buffers(bs, heads, head_dim, splits, q.device),
                     scale=head_dim**-0.5, max_kv_splits=splits)
    prefix_plan = plan_items(plan, batch_size=bs, members=members, max_items=64)
    num_items = len(prefix_plan.items) + 1  # + an empty item (graphs pad to a fixed count)
    shared = SharedPrefixes.view(torch.tensor(prefix_plan.flat(num_items, members),
                                              device=device),
                                 batch_size=bs, num_items=num_items, members=members)
    out = torch.empty_like(q)
    # the prefix's partials sit after the suffix's splits, however few the config launches
    config = decode_config(head_dim, dtype, shared=True)._replace(max_splits=suffix_splits)
    decode_attention(q, k_buffer, v_buffer, out, kv_indptr, kv_indices,
                     *partial_buffers(bs, heads, head_dim, splits + PREFIX_SPLITS, q.device),
                     scale=head_dim**-0.5, max_kv_splits=splits, config=config, shared=shared)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected.double(), atol=tol, rtol=tol)


def test_plan_items_cuts_prefixes_into_parts_and_tiles():
    n = PART_MIN_TOKENS
    plan = plan_items([(2 * n, [4, 0, 2]), (7, [1, 3])], batch_size=6, members=2, max_items=16)
    assert plan.kv_skip == [2 * n, 7, 2 * n, 7, 2 * n, 0]
    assert plan.prefix_parts == [2, 1, 2, 1, 2, 0]
    assert plan.items == [[4, 0, n, 0, 4, 0], [4, n, 2 * n, 1, 4, 0],
                          [2, 0, n, 0, 2, -1], [2, n, 2 * n, 1, 2, -1], [1, 0, 7, 0, 1, 3]]
    assert len(plan.flat(8, 2)) == 12 + 8 * 6


def test_plan_items_keeps_the_groups_that_save_most():
    groups = [(100, [0, 1]), (1000, [2, 3, 4]), (50, [5, 6])]
    plan = plan_items(groups, batch_size=8, members=4, max_items=2)
    assert plan.kv_skip == [100, 100, 1000, 1000, 1000, 0, 0, 0]
    assert [item[2] for item in plan.items] == [1000, 100]
    assert max(plan.prefix_parts) <= PREFIX_SPLITS


@pytest.mark.parametrize("device", DEVICES)
def test_runtime_groups_forks_and_matches_plain_decode(device, tiny_models):
    """Requests sharing a cached prefix decode in groups (graphs on CUDA) with the same greedy
    tokens as without grouping; KV accounting holds every step."""
    import lmnb

    rng = random.Random(7)
    prefixes = [[rng.randrange(100, 40000) for _ in range(70)] for _ in range(2)]
    prompts = [p + [rng.randrange(100, 40000) for _ in range(4)] for p in prefixes
               for _ in range(3)] + [[5, 6, 7]]
    outputs, groups = {}, []
    for disabled in (False, True):
        with lmnb.Runtime(tiny_models["llama-gqa"], attention_backend="triton", device=device,
                          dtype="float32", check_integrity_each_step=True,
                          disable_shared_prefix_decode=disabled) as rt:
            rt.set_batch_hook(lambda b: groups.append(b.shared_prefixes)
                              if b.mode.name == "DECODE" else None)
            outputs[disabled] = [o["output_ids"] for o in rt.generate(
                input_ids=prompts, sampling_params={"max_new_tokens": 3, "temperature": 0,
                                                    "ignore_eos": True})]
            rt.set_batch_hook(None)
        if not disabled:
            assert sorted(len(rows) for _, rows in groups[-1]) == [3, 3]
            assert {length for length, _ in groups[-1]} == {70}
    assert outputs[False] == outputs[True]


def test_only_the_full_height_is_captured_by_default():
    """16-row variants cost more start than they save (shared_prefix.TILE_HEIGHTS)."""
    assert TILE_HEIGHTS == (BLOCK_M,)
    assert tile_rows_for([(600, [0, 1, 2, 3])], 32, 8) == BLOCK_M


@pytest.fixture
def small_tiles(monkeypatch):
    """The 16-row height among the captured ones."""
    from lmnb.runtime.kernels import shared_prefix

    monkeypatch.setattr(shared_prefix, "TILE_HEIGHTS", (BLOCK_M, SMALL_TILE_ROWS))


def test_tile_rows_follow_the_largest_group(small_tiles):
    assert SMALL_TILE_ROWS == 16 and BLOCK_M == 64
    fork, few_shot = (600, [0, 1, 2, 3]), (1500, list(range(4, 36)))
    # GQA 4: two 16-row tiles hold 8 members
    assert tile_rows_for([fork], 32, 8) == 16
    assert tile_rows_for([fork, (90, list(range(40, 48)))], 32, 8) == 16
    assert tile_rows_for([fork, few_shot], 32, 8) == 64
    assert tile_rows_for([(90, list(range(9)))], 32, 8) == 64
    assert tile_rows_for([fork], 32, 32) == 16  # MHA: 32 members
    assert tile_rows_for([fork], 32, 1) == 64  # a GQA group of 32 is two 16-row tiles' worth
    # GQA 16: a 16-row tile holds one request, whose prefix it reads alone: a pair would form
    # two one-member tiles that save nothing, and lose its group (64 rows: one tile of two)
    pair = (600, [0, 1])
    assert not plan_items([pair], batch_size=2, members=members_per_tile(32, 2, 16),
                          max_items=8).items
    assert tile_rows_for([pair], 32, 2) == 64


@pytest.mark.parametrize(("heads", "kv_heads", "variants"), [
    (8, 2, (64, 16)), (2, 2, (64, 16)), (32, 4, (64, 16)),  # GQA 4, MHA, GQA 8 (2 a tile)
    (32, 2, (64,)), (32, 1, (64,)),  # GQA 16 and 32: 16 rows hold no two requests
    (64, 1, ())])  # GQA 64: a 64-row tile holds one request: no shared-prefix decode
def test_backend_variants_are_the_heights_whose_tiles_share(heads, kv_heads, variants,
                                                           small_tiles):
    from lmnb.runtime.kernels.triton_backend import TritonAttention
    from lmnb.runtime.memory import KVStorage, ReqToTokenPool

    pool = ReqToTokenPool(4, 64, torch.device("cpu"))
    storage = KVStorage(64, num_layers=1, kv_heads=kv_heads, head_dim=16, dtype=torch.float32,
                        device=torch.device("cpu"))
    backend = TritonAttention(num_heads=heads, num_kv_heads=kv_heads, head_dim=16,
                              req_to_token_pool=pool, kv_storage=storage)
    assert backend.prefix_variants == variants
    assert backend.supports_shared_prefixes == bool(variants)


@pytest.mark.parametrize("device", DEVICES)
def test_graph_variants_follow_the_groups_tile_height(device, tiny_models, monkeypatch,
                                                     small_tiles):
    """Forks of 3 replay the 16-row shared-prefix graphs, a group of 18 the 64-row ones (on the
    CPU: the graph runner's padded static batches run eagerly), with the greedy tokens of
    decoding without groups."""
    import functools

    import lmnb
    from lmnb.runtime import model_runner
    from lmnb.runtime.graph_runner import DecodeGraphRunner
    from lmnb.runtime.kernels.triton_backend import TritonAttention

    if device == "cpu":
        monkeypatch.setattr(model_runner, "graph_max_bs", lambda **_: 32)
        monkeypatch.setattr(model_runner, "DecodeGraphRunner",
                            functools.partial(DecodeGraphRunner, capture=False))
    picked: list[int] = []
    pick = TritonAttention.prefix_rows

    def spy(self, forward_batch):
        picked.append(pick(self, forward_batch))
        return picked[-1]

    monkeypatch.setattr(TritonAttention, "prefix_rows", spy)
    rng = random.Random(11)
    prefixes = [[rng.randrange(100, 40000) for _ in range(70)] for _ in range(3)]
    forks = [p + [rng.randrange(100, 40000) for _ in range(3)] for p in prefixes[:2]
             for _ in range(3)]
    crowd = [prefixes[2] + [rng.randrange(100, 40000) for _ in range(3)] for _ in range(18)]
    params = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}  # one decode step
    outputs = {}
    for disabled in (False, True):
        with lmnb.Runtime(tiny_models["llama-gqa"], attention_backend="triton", device=device,
                          dtype="float32", check_integrity_each_step=True,
                          disable_shared_prefix_decode=disabled) as rt:
            outputs[disabled] = [[o["output_ids"] for o in rt.generate(input_ids=prompts,
                                                                       sampling_params=params)]
                                 for prompts in (forks, crowd)]
            if not disabled:
                assert rt.stats()["cuda_graph_replays"] > 0
                assert {16, 64} <= set(picked)
    assert outputs[False] == outputs[True]
