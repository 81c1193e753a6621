"""RadixCache against a brute-force model, the paper's Figure 3 walk-through, and edge cases.

The reference model is a dict {(namespace, prefix): slot} holding every cached token position: a
token at position i of key k is cached iff the prefix k[:i+1] is a key of the dict.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from lmnb.runtime.core import Req, SamplingParams
from lmnb.runtime.memory import KVAllocator, ReqToTokenPool
from lmnb.runtime.radix import cache as radix_module
from lmnb.runtime.radix.cache import RadixCache, TreeNode
from lmnb.runtime.scheduler import CacheManager

CPU = torch.device("cpu")
Prefix = tuple[Hashable, tuple[int, ...]]


class FakeClock:
    """Stands in for the `time` module inside the cache: each call is one tick later."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        self.now += 1.0
        return self.now


class RecordingPool(KVAllocator):
    """A KV pool that remembers each `free` call, so eviction order can be checked."""

    def __init__(self, size: int) -> None:
        super().__init__(size, CPU)
        self.freed: list[list[int]] = []

    def free(self, slots: torch.Tensor) -> None:
        self.freed.append(slots.tolist())
        super().free(slots)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(radix_module, "time", fake)
    return fake


def make_cache(size: int, max_reqs: int = 4,
               context: int = 64) -> tuple[RadixCache, RecordingPool, ReqToTokenPool]:
    pool = RecordingPool(size)
    req_pool = ReqToTokenPool(max_reqs, context, CPU)
    return RadixCache(pool), pool, req_pool


def contents(cache: RadixCache) -> dict[Prefix, int]:
    """Every cached token position of the tree as {(namespace, prefix): slot}."""
    out: dict[Prefix, int] = {}
    stack = [(child, ()) for child in cache.root.children.values()]
    while stack:
        node, above = stack.pop()
        for i, slot in enumerate(node.value.tolist()):
            out[(node.namespace, above + tuple(node.key[:i + 1]))] = slot
        full = above + tuple(node.key)
        stack.extend((child, full) for child in node.children.values())
    return out


def path_key(node: TreeNode) -> list[int]:
    parts = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return [token for part in reversed(parts) for token in part]


def attached(cache: RadixCache, node: TreeNode) -> bool:
    while node is not cache.root:
        if node.parent is None or node.parent.children.get((node.namespace, node.key[0])) \
                is not node:
            return False
        node = node.parent
    return True


def free_slots(pool: KVAllocator) -> list[int]:
    return pool.free_slots().tolist()


def conserved(cache: RadixCache, pool: KVAllocator, owned: int = 0) -> bool:
    return (pool.available() + cache.evictable_size() + cache.protected_size() + owned
            == pool.size)


# ---- the fuzz test ----------------------------------------------------------------------------

POOL_SIZE = 200
MAX_KEY = 12
TOKENS = st.integers(0, 3)
NAMESPACES = st.sampled_from([None, None, None, "a"])


class RadixMachine(RuleBasedStateMachine):
    """Random inserts, matches, locks, unlocks, evictions and request lifecycles, each checked
    against the reference dict; the tree must equal the reference after every step."""

    clock: FakeClock
    steps = 0

    def __init__(self) -> None:
        super().__init__()
        self.cache, self.pool, self.req_pool = make_cache(POOL_SIZE, max_reqs=2, context=32)
        self.ref: dict[Prefix, int] = {}
        self.touched: dict[Prefix, float] = {}  # clock time just before the last use of a prefix
        self.locks: list[tuple[Hashable, tuple[int, ...], TreeNode]] = []
        self.seen: list[list[int]] = []

    # -- helpers
    def draw_key(self, data: st.DataObject, max_size: int = MAX_KEY) -> list[int]:
        fresh = data.draw(st.lists(TOKENS, min_size=0, max_size=max_size), label="tokens")
        if self.seen and data.draw(st.booleans(), label="derived"):
            base = data.draw(st.sampled_from(self.seen), label="base")
            cut = data.draw(st.integers(0, len(base)), label="cut")
            fresh = base[:cut] + fresh  # shares a prefix with an earlier key, may end mid-edge
        key = (fresh or [0])[:max_size]
        self.seen = (self.seen + [key])[-40:]
        return key

    def ref_match(self, ns: Hashable, key: Sequence[int]) -> list[int]:
        slots = []
        for i in range(len(key)):
            slot = self.ref.get((ns, tuple(key[:i + 1])))
            if slot is None:
                break
            slots.append(slot)
        return slots

    def touch(self, ns: Hashable, key: Sequence[int], before: float) -> None:
        for i in range(len(key)):
            self.touched[(ns, tuple(key[:i + 1]))] = before

    def record_new(self, ns: Hashable, key: Sequence[int], slots: Sequence[int]) -> None:
        for i in range(len(key)):
            self.ref.setdefault((ns, tuple(key[:i + 1])), slots[i])

    def evict(self, n: int) -> int:
        cache, pool = self.cache, self.pool
        nodes = {node.id: node for node in cache._nodes()}
        parent = {i: node.parent.id for i, node in nodes.items()}
        children = {i: len(node.children) for i, node in nodes.items()}
        lock = {i: node.lock_ref for i, node in nodes.items()}
        stamp = {i: node.last_access for i, node in nodes.items()}
        by_first_slot = {int(node.value[0]): i for i, node in nodes.items()}
        evictable, available = cache.evictable_size(), pool.available()
        pool.freed.clear()
        freed = cache.evict(n)
        order = [by_first_slot[slots[0]] for slots in pool.freed]

        assert freed >= min(n, evictable) and freed <= evictable
        assert pool.available() == available + freed
        assert cache.evictable_size() == evictable - freed
        assert [len(s) for s in pool.freed] == [len(nodes[i].key) for i in order]
        assert all(pool.freed[k] == nodes[i].value.tolist() for k, i in enumerate(order))
        # Leaf-first LRU: each evicted node was, at its turn, an unlocked leaf of least recent use.
        total = 0
        for i in order:
            assert total < n, "evicted past the request"
            candidates = [j for j in nodes if children[j] == 0 and lock[j] == 0]
            assert i in candidates
            assert stamp[i] == min(stamp[j] for j in candidates), "not the LRU leaf"
            total += len(nodes[i].key)
            del nodes[i]
            if parent[i] in children:
                children[parent[i]] -= 1
        if total < n:
            assert not [j for j in nodes if children[j] == 0 and lock[j] == 0]

        after = contents(cache)
        assert after.items() <= self.ref.items(), "eviction changed or added entries"
        gone = sorted(self.ref[p] for p in self.ref.keys() - after.keys())
        assert gone == sorted(s for slots in pool.freed for s in slots)
        for ns, key, node in self.locks:
            assert attached(cache, node) and path_key(node) == list(key)
            assert self.ref_match(ns, key) == [after[(ns, key[:i + 1])] for i in range(len(key))]
        self.ref = after
        return freed

    def make_room(self, n: int) -> bool:
        short = n - self.pool.available()
        if short <= 0:
            return True
        if short > self.cache.evictable_size():
            return False
        self.evict(short)
        assert self.pool.available() >= n
        return True

    def match(self, ns: Hashable, key: list[int], *, full: bool) -> tuple[torch.Tensor, TreeNode]:
        expected = self.ref_match(ns, key if full else key[:-1])
        before = self.clock.now
        if full:
            indices, node = self.cache._match(list(key), ns)
        else:
            indices, node = self.cache.match_prefix(key, ns)
            assert len(indices) <= max(len(key) - 1, 0)
        assert indices.tolist() == expected
        assert path_key(node) == key[:len(expected)]
        assert node is self.cache.root or node.namespace == ns
        self.touch(ns, key[:len(expected)], before)
        return indices, node

    def insert_fresh(self, ns: Hashable, key: list[int]) -> None:
        """Inserts `key` with newly allocated slots, freeing the duplicates like the scheduler."""
        slots = self.pool.alloc(len(key))
        expected = len(self.ref_match(ns, key))
        before = self.clock.now
        already = self.cache.insert(key, slots, ns)
        assert already == expected
        self.pool.free(slots[:already])
        self.touch(ns, key, before)
        self.record_new(ns, key, slots.tolist())

    # -- rules
    @rule(data=st.data(), ns=NAMESPACES)
    def insert(self, data: st.DataObject, ns: Hashable) -> None:
        RadixMachine.steps += 1
        key = self.draw_key(data)
        if self.make_room(len(key)):
            self.insert_fresh(ns, key)

    @rule(data=st.data(), ns=NAMESPACES, full=st.booleans(), lock=st.booleans())
    def match_key(self, data: st.DataObject, ns: Hashable, full: bool, lock: bool) -> None:
        RadixMachine.steps += 1
        key = self.draw_key(data)
        indices, node = self.match(ns, key, full=full)
        if lock:
            self.cache.lock(node)
            self.locks.append((ns, tuple(key[:len(indices)]), node))

    @precondition(lambda self: self.locks)
    @rule(which=st.integers(0, 63))
    def unlock(self, which: int) -> None:
        RadixMachine.steps += 1
        _, _, node = self.locks.pop(which % len(self.locks))
        self.cache.unlock(node)

    @rule(n=st.integers(0, 48))
    def evict_some(self, n: int) -> None:
        RadixMachine.steps += 1
        self.evict(n)

    @rule(data=st.data(), ns=NAMESPACES, chunk=st.integers(1, MAX_KEY),
          race=st.sampled_from([None, "unfinished", "finished"]))
    def request(self, data: st.DataObject, ns: Hashable, chunk: int, race: str | None) -> None:
        """One request as the scheduler runs it: match, lock, prefill in two chunks (caching the
        first with cache_unfinished_req), decode, cache_finished_req. A rival request may cache
        the same tokens meanwhile, so that the request's own slots become duplicates."""
        RadixMachine.steps += 1
        cache, pool = self.cache, self.pool
        prompt = self.draw_key(data)
        output = data.draw(st.lists(TOKENS, max_size=4), label="output")
        req = Req(origin_input_ids=prompt, sampling_params=SamplingParams(), extra_key=ns)
        req.output_ids = output
        fill = req.fill_ids
        prefix, node = self.match(ns, prompt, full=False)
        cache.lock(node)
        self.locks.append((ns, tuple(prompt[:len(prefix)]), node))
        p, total = len(prefix), len(fill)
        first = min(p + chunk, total)
        rival = {None: 0, "unfinished": first, "finished": total}[race]
        if not self.make_room(total - p + rival):
            self.locks.pop()
            cache.unlock(node)
            return
        self.locks.pop()  # the request holds it from here on; nothing is evicted until it ends
        req.req_pool_idx = self.req_pool.alloc()
        row = self.req_pool.req_to_token[req.req_pool_idx]
        row[:p] = prefix
        row[p:total] = pool.alloc(total - p)
        req.prefix_len, req.cache_handle, req.kv_len = len(prefix), node, first

        if race == "unfinished":
            self.insert_fresh(ns, fill[:first])
        if first < total:
            own = row[:first].tolist()
            before = self.clock.now
            CacheManager(cache, cache.allocator, self.req_pool).cache_unfinished(req)
            self.touch(ns, fill[:first], before)
            self.record_new(ns, fill[:first], own)
            expected = [self.ref[(ns, tuple(fill[:i + 1]))] for i in range(first)]
            assert req.prefix_len == len(expected) and expected == row[:first].tolist()
            assert path_key(req.cache_handle) == fill[:first] and req.cache_handle.lock_ref > 0
            assert conserved(cache, pool, owned=total - first)
            cache.check()
        if race == "finished":
            self.insert_fresh(ns, fill)
        req.kv_len = total
        own = row[:total].tolist()
        before = self.clock.now
        CacheManager(cache, cache.allocator, self.req_pool).cache_finished(req)
        self.touch(ns, fill, before)
        self.record_new(ns, fill, own)

    # -- after every step
    @invariant()
    def agrees_with_reference(self) -> None:
        cache, pool = self.cache, self.pool
        cache.check()
        assert contents(cache) == self.ref
        assert conserved(cache, pool)
        assert sorted(free_slots(pool) + list(self.ref.values())) == list(range(1, pool.size + 1))
        locked = {(ns, key[:i + 1]) for ns, key, _ in self.locks for i in range(len(key))}
        assert cache.protected_size() == len(locked)
        assert cache.evictable_size() == len(self.ref) - len(locked)
        expected_refs: dict[int, int] = {}
        for _, _, node in self.locks:
            assert attached(cache, node)
            while node is not cache.root:
                expected_refs[node.id] = expected_refs.get(node.id, 0) + 1
                node = node.parent
        above: dict[int, tuple[int, ...]] = {}
        for node in cache._nodes():  # parents come before children
            assert node.lock_ref == expected_refs.get(node.id, 0)
            head = above.get(node.parent.id, ())
            above[node.id] = head + tuple(node.key)
            for i in range(len(node.key)):
                seen_at = self.touched.get((node.namespace, head + tuple(node.key[:i + 1])))
                assert seen_at is not None and node.last_access > seen_at, "stale recency"


def test_fuzz_against_reference(clock: FakeClock) -> None:
    RadixMachine.clock = clock
    RadixMachine.steps = 0
    run_state_machine_as_test(RadixMachine, settings=settings(
        max_examples=240, stateful_step_count=60, deadline=None, database=None,
        derandomize=True, suppress_health_check=list(HealthCheck)))
    assert RadixMachine.steps >= 10_000


# ---- the paper's Figure 3 ---------------------------------------------------------------------

# Each text is a run of distinct token ids; a run's length stands for its token count.
TEXTS = {
    "SYS": 8,        # "You are a helpful assistant."
    "HELLO": 3,      # "User: Hello!"
    "HI": 2,         # "Assistant: Hi!"
    "SOLVE": 4,      # "User: Solve this problem ..."
    "SOLVE_A": 4,    # "Assistant: Sure! ..."
    "WHAT": 3,       # "User: What can you do?"          (chat session 2)
    "ICAN": 3,       # "Assistant: I can ..."
    "STORY": 4,      # "User: Write a story ..."
    "STORY_A": 4,    # "Assistant: Once upon a time ..."
    "FEWSHOT": 10,   # "Question 1: ... Answer 1: ... Question 2: ... Answer 2: ..." (examples)
    "Q1": 2, "A1": 2, "Q2": 2, "A2": 2,  # few-shot queries and their answers
    "Q3": 2, "A3": 2, "Q4": 2, "A4": 2,
    "QUESTION": 2,   # the question sampled several times (self-consistency)
    "S1": 2, "S2": 2, "S3": 2,  # the sampled answers
    "HELLO3": 3,     # "User: Hey there!"                (chat session 3)
    "HI3": 2,        # "Assistant: Hello!"
}
RUNS = {}
_next = 1000
for _name, _length in TEXTS.items():
    RUNS[_name] = list(range(_next, _next + _length))
    _next += 100
RUN_OF = {run[0]: name for name, run in RUNS.items()}


def ids(*names: str) -> list[int]:
    return [token for name in names for token in RUNS[name]]


def label(tokens: list[int]) -> str:
    """Names the texts a node's key spans, e.g. "SYS+HELLO+HI"; nodes start and end on texts."""
    names, i = [], 0
    while i < len(tokens):
        name = RUN_OF[tokens[i]]
        assert tokens[i:i + len(RUNS[name])] == RUNS[name], "node boundary inside a text"
        names.append(name)
        i += len(RUNS[name])
    return "+".join(names)


def shape(cache: RadixCache) -> dict:
    """The tree as nested {label: children}; checks each row's token count on the way."""
    rows = cache.snapshot(preview_tokens=1000)
    nested: dict[int, dict] = {rows[0]["id"]: {}}
    for row in rows[1:]:
        name = label(row["key_preview"])
        assert row["tokens"] == sum(TEXTS[n] for n in name.split("+"))
        nested[row["id"]] = {}
        nested[row["parent"]][name] = nested[row["id"]]
    return nested[rows[0]["id"]]


def node_ids(cache: RadixCache) -> dict[str, int]:
    """{path label: node id}, the path label joining the labels from the root down."""
    out, path = {}, {}
    for row in cache.snapshot(preview_tokens=1000)[1:]:
        name = label(row["key_preview"])
        path[row["id"]] = (path[row["parent"]] + "/" if row["parent"] in path else "") + name
        out[path[row["id"]]] = row["id"]
    return out


class Server:
    """Runs requests through the cache the way the scheduler does."""

    def __init__(self, size: int) -> None:
        self.cache, self.pool, self.req_pool = make_cache(size, max_reqs=4, context=64)
        self.evicted: list[str] = []  # labels of evicted nodes, in eviction order
        self.running: list[Req] = []

    def start(self, prompt: list[int], output: list[int]) -> Req:
        cache, pool = self.cache, self.pool
        req = Req(origin_input_ids=prompt, sampling_params=SamplingParams())
        prefix, node = cache.match_prefix(prompt)
        cache.lock(node)
        req.req_pool_idx = self.req_pool.alloc()
        req.prefix_len, req.cache_handle = len(prefix), node
        req.output_ids = output
        need = len(req.fill_ids) - len(prefix)
        short = need - pool.available()
        if short > 0:
            labels = {node.value[0].item(): label(node.key) for node in cache._nodes()}
            pool.freed.clear()
            assert cache.evict(short) >= short
            self.evicted += [labels[slots[0]] for slots in pool.freed]
        row = self.req_pool.req_to_token[req.req_pool_idx]
        row[:len(prefix)] = prefix
        row[len(prefix):len(req.fill_ids)] = pool.alloc(need)
        req.kv_len = len(req.fill_ids)
        self.running.append(req)
        self.check()
        return req

    def finish(self, req: Req) -> None:
        CacheManager(self.cache, self.cache.allocator, self.req_pool).cache_finished(req)
        self.running.remove(req)
        self.check()

    def serve(self, prompt: list[int], output: list[int]) -> None:
        self.finish(self.start(prompt, output))

    def check(self) -> None:
        self.cache.check()
        assert conserved(self.cache, self.pool, owned=sum(r.owned_kv_len for r in self.running))


def test_paper_figure_3(clock: FakeClock) -> None:
    server = Server(size=34)  # too small to keep every request's KV
    cache = server.cache

    # (1) The tree starts empty.
    assert shape(cache) == {} and cache.evictable_size() == 0

    # (2) Chat session 1: system prompt + "Hello!" -> "Hi!" becomes one edge.
    server.serve(ids("SYS", "HELLO"), ids("HI"))
    assert shape(cache) == {"SYS+HELLO+HI": {}}
    first_turn = node_ids(cache)["SYS+HELLO+HI"]

    # (3) Session 1 continues; it reuses the whole first turn and appends the new turn.
    server.serve(ids("SYS", "HELLO", "HI", "SOLVE"), ids("SOLVE_A"))
    assert shape(cache) == {"SYS+HELLO+HI": {"SOLVE+SOLVE_A": {}}}
    assert node_ids(cache)["SYS+HELLO+HI"] == first_turn  # extended, not copied

    # (4) Chat session 2 shares only the system prompt: the first-turn node splits after it.
    server.serve(ids("SYS", "WHAT"), ids("ICAN"))
    assert shape(cache) == {"SYS": {"HELLO+HI": {"SOLVE+SOLVE_A": {}}, "WHAT+ICAN": {}}}
    nodes = node_ids(cache)
    assert nodes["SYS/HELLO+HI"] == first_turn  # the old node keeps the lower half ...
    assert nodes["SYS"] > first_turn  # ... and a new node takes the system prompt
    assert server.evicted == [] and server.pool.available() == 34 - 27

    # (5) Session 2 continues; the pool is full, so session 1's latest turn (the LRU leaf) goes.
    server.serve(ids("SYS", "WHAT", "ICAN", "STORY"), ids("STORY_A"))
    assert server.evicted == ["SOLVE+SOLVE_A"]
    assert shape(cache) == {"SYS": {"HELLO+HI": {}, "WHAT+ICAN": {"STORY+STORY_A": {}}}}

    # (6) A few-shot batch: the first query opens a new branch from the root (evicting session
    # 1's first turn, then session 2's latest turn), the second splits it after the examples.
    server.evicted.clear()
    server.serve(ids("FEWSHOT", "Q1"), ids("A1"))
    assert server.evicted == ["HELLO+HI", "STORY+STORY_A"]
    assert shape(cache) == {"SYS": {"WHAT+ICAN": {}}, "FEWSHOT+Q1+A1": {}}
    query_1 = node_ids(cache)["FEWSHOT+Q1+A1"]
    server.serve(ids("FEWSHOT", "Q2"), ids("A2"))
    assert shape(cache) == {"SYS": {"WHAT+ICAN": {}},
                            "FEWSHOT": {"Q1+A1": {}, "Q2+A2": {}}}
    assert node_ids(cache)["FEWSHOT/Q1+A1"] == query_1
    assert server.evicted == ["HELLO+HI", "STORY+STORY_A"]

    # (7) More few-shot queries join as siblings; session 2's turn is now the LRU leaf.
    server.serve(ids("FEWSHOT", "Q3"), ids("A3"))
    assert server.evicted[2:] == ["WHAT+ICAN"]
    server.serve(ids("FEWSHOT", "Q4"), ids("A4"))
    assert server.evicted[3:] == []
    assert shape(cache) == {"SYS": {},
                            "FEWSHOT": {"Q1+A1": {}, "Q2+A2": {}, "Q3+A3": {}, "Q4+A4": {}}}

    # (8) Self-consistency: three samples of one question run at once. They lock the few-shot
    # prefix, which stays while the leftover system prompt and the oldest query make room.
    server.evicted.clear()
    samples = [server.start(ids("FEWSHOT", "QUESTION"), ids(s)) for s in ("S1", "S2", "S3")]
    assert server.evicted == ["SYS", "Q1+A1"]
    fewshot = samples[0].cache_handle
    assert label(fewshot.key) == "FEWSHOT" and fewshot.lock_ref == 3
    assert cache.protected_size() == 10 and cache.evictable_size() == 12
    assert server.pool.available() == 0
    server.finish(samples[0])
    assert shape(cache)["FEWSHOT"]["QUESTION+S1"] == {}
    server.finish(samples[1])  # shares QUESTION with sample 1: split, duplicate slots freed
    assert shape(cache) == {"FEWSHOT": {"Q2+A2": {}, "Q3+A3": {}, "Q4+A4": {},
                                        "QUESTION": {"S1": {}, "S2": {}}}}
    assert fewshot.lock_ref == 1 and cache.protected_size() == 10
    assert server.pool.available() == 2

    # (9) A new chat session needs 13 slots: the least recently used leaves (the old queries) are
    # evicted, the fresher samples stay, and the prefix locked by sample 3 is untouched.
    server.evicted.clear()
    server.serve(ids("SYS", "HELLO3"), ids("HI3"))
    assert server.evicted == ["Q2+A2", "Q3+A3", "Q4+A4"]
    assert shape(cache) == {"FEWSHOT": {"QUESTION": {"S1": {}, "S2": {}}},
                            "SYS+HELLO3+HI3": {}}
    assert attached(cache, fewshot) and fewshot.lock_ref == 1
    server.finish(samples[2])
    assert shape(cache) == {"FEWSHOT": {"QUESTION": {"S1": {}, "S2": {}, "S3": {}}},
                            "SYS+HELLO3+HI3": {}}
    assert cache.protected_size() == 0 and cache.evictable_size() == 31
    assert server.pool.available() == 3

    # Afterwards: with one prefix locked, evicting everything leaves exactly that prefix.
    _, held = cache._match(ids("FEWSHOT", "QUESTION", "S3"), None)
    cache.lock(held)
    assert cache.evict(1000) == 31 - 14
    assert shape(cache) == {"FEWSHOT": {"QUESTION": {"S3": {}}}}
    cache.unlock(held)
    assert cache.evict(1000) == 14 and shape(cache) == {}
    assert server.pool.available() == 34


# ---- targeted tests ---------------------------------------------------------------------------

def test_match_prefix_leaves_one_token_to_compute() -> None:
    cache, pool, _ = make_cache(16)
    slots = pool.alloc(4)
    assert cache.insert([1, 2, 3, 4], slots) == 0
    indices, node = cache.match_prefix([1, 2, 3, 4])
    assert indices.tolist() == slots[:3].tolist() and node.key == [1, 2, 3]
    assert [child.key for child in node.children.values()] == [[4]]  # split mid-edge
    assert cache.node_count() == 2 and cache.evictable_size() == 4
    assert cache._match([1, 2, 3, 4], None).indices.tolist() == slots.tolist()
    assert cache.match_prefix([1, 2, 3, 4, 5]).indices.tolist() == slots.tolist()
    assert len(cache.match_prefix([1]).indices) == 0
    assert cache.match_prefix([]).handle is cache.root
    assert len(cache.match_prefix([2, 1]).indices) == 0
    cache.check()


def test_insert_ending_or_diverging_mid_edge_splits() -> None:
    cache, pool, _ = make_cache(16)
    a = pool.alloc(5)
    cache.insert([1, 2, 3, 4, 5], a)
    _, leaf = cache._match([1, 2, 3, 4, 5], None)
    cache.lock(leaf)

    b = pool.alloc(3)
    assert cache.insert([1, 2, 3], b) == 3  # ends mid-edge: all already there
    pool.free(b)
    upper = leaf.parent
    assert upper.key == [1, 2, 3] and upper.value.tolist() == a[:3].tolist()
    assert leaf.key == [4, 5] and leaf.value.tolist() == a[3:].tolist()
    assert upper.lock_ref == 1 and upper.parent is cache.root

    c = pool.alloc(3)
    assert cache.insert([1, 2, 9], c) == 2  # diverges mid-edge
    pool.free(c[:2])
    top = upper.parent
    assert top.key == [1, 2] and sorted(k for _, k in top.children) == [3, 9]
    assert top.children[(None, 9)].value.tolist() == c[2:].tolist()
    assert upper.key == [3] and top.lock_ref == 1
    assert cache.protected_size() == 5 and cache.evictable_size() == 1
    assert conserved(cache, pool)
    cache.check()

    cache.unlock(leaf)
    assert cache.protected_size() == 0 and cache.evictable_size() == 6
    with pytest.raises(AssertionError):
        cache.unlock(leaf)


def test_key_diverging_after_a_split_edge_stops_there() -> None:
    # [1, 2, 3] -> [4, 5]; the key [1, 2, 4] departs 2 tokens into the 3-token edge, whose lower
    # half ([3]) is shorter than that: the walk must end at the split, not go on below [3] (where
    # a child starts with 4 too)
    cache, pool, _ = make_cache(16)
    a = pool.alloc(5)
    cache.insert([1, 2, 3], a[:3])
    assert cache.insert([1, 2, 3, 4, 5], a) == 3
    assert cache.cached_length([1, 2, 4]) == 2
    assert cache.handle_of([1, 2, 4]).key == [1, 2]
    b = pool.alloc(3)
    assert cache.insert([1, 2, 4], b) == 2
    assert cache.cached_length([1, 2, 4]) == 3 and cache.cached_length([1, 2, 3, 4, 5]) == 5
    pool.free(b[:2])
    assert conserved(cache, pool)
    cache.check()


def test_unfinished_then_finished_req_frees_duplicates_and_balances_locks() -> None:
    cache, pool, req_pool = make_cache(40)
    prompt = list(range(10, 20))
    shared = pool.alloc(4)
    cache.insert(prompt[:4], shared)

    req = Req(origin_input_ids=prompt, sampling_params=SamplingParams())
    prefix, node = cache.match_prefix(prompt)
    assert prefix.tolist() == shared.tolist()
    cache.lock(node)
    req.req_pool_idx = req_pool.alloc()
    req.prefix_len, req.cache_handle, req.kv_len = len(prefix), node, 4
    row = req_pool.req_to_token[req.req_pool_idx]
    row[:4] = prefix
    first = pool.alloc(3)  # the first prefill chunk: prompt positions 4..6
    row[4:7] = first
    req.kv_len = 7
    assert cache.protected_size() == 4 and conserved(cache, pool, owned=req.owned_kv_len)

    # Another request cached prompt[:6] meanwhile: positions 4 and 5 of this one are duplicates.
    rival = pool.alloc(6)
    assert cache.insert(prompt[:6], rival) == 4
    pool.free(rival[:4])

    CacheManager(cache, cache.allocator, req_pool).cache_unfinished(req)
    expected = shared.tolist() + rival[4:6].tolist() + first[2:].tolist()
    assert req.prefix_len == len(expected) and expected == row[:7].tolist()
    assert req.cache_handle.key == prompt[6:7] and req.cache_handle.lock_ref == 1
    assert node.lock_ref == 1  # the old lock moved down, it was not doubled
    assert cache.protected_size() == 7 and cache.evictable_size() == 0
    assert set(first[:2].tolist()) <= set(free_slots(pool))  # the duplicates were freed
    assert req.owned_kv_len == 0 and conserved(cache, pool)

    rest = pool.alloc(5)  # the second chunk (positions 7..9) and two output tokens
    row[7:12] = rest
    req.output_ids = [90, 91]
    req.kv_len = 12
    assert conserved(cache, pool, owned=req.owned_kv_len)
    CacheManager(cache, cache.allocator, req_pool).cache_finished(req)
    assert cache.protected_size() == 0 and cache.evictable_size() == 12
    assert conserved(cache, pool)
    assert sorted(free_slots(pool) + row[:12].tolist()) == list(range(1, 41))
    assert cache._match(prompt + [90, 91], None).indices.tolist() == expected + rest.tolist()
    assert all(n.lock_ref == 0 for n in cache._nodes())
    cache.check()


def test_finished_req_with_fully_cached_prompt_frees_its_recomputed_token() -> None:
    cache, pool, req_pool = make_cache(20)
    prompt = [5, 6, 7]
    slots = pool.alloc(3)
    cache.insert(prompt, slots)
    req = Req(origin_input_ids=prompt, sampling_params=SamplingParams())
    prefix, node = cache.match_prefix(prompt)
    assert len(prefix) == 2
    cache.lock(node)
    req.req_pool_idx = req_pool.alloc()
    req.prefix_len, req.cache_handle, req.kv_len = len(prefix), node, 3
    row = req_pool.req_to_token[req.req_pool_idx]
    row[:2] = prefix
    recomputed = pool.alloc(1)
    row[2:3] = recomputed
    CacheManager(cache, cache.allocator, req_pool).cache_finished(req)
    assert recomputed.item() in free_slots(pool)
    assert cache.protected_size() == 0 and cache.evictable_size() == 3 and conserved(cache, pool)
    assert cache._match(prompt, None).indices.tolist() == slots.tolist()


def test_namespaces_do_not_share() -> None:
    cache, pool, _ = make_cache(20)
    plain, media = pool.alloc(3), pool.alloc(3)
    assert cache.insert([1, 2, 3], plain) == 0
    assert len(cache.match_prefix([1, 2, 3, 4], "a").indices) == 0
    assert cache.insert([1, 2, 3], media, "a") == 0
    assert cache._match([1, 2, 3], None).indices.tolist() == plain.tolist()
    assert cache._match([1, 2, 3], "a").indices.tolist() == media.tolist()
    slots = pool.alloc(3)
    assert cache.insert([1, 2, 4], slots, "a") == 2
    pool.free(slots[:2])
    assert cache._match([1, 2, 4], None).indices.tolist() == plain[:2].tolist()
    assert {row["namespace"] for row in cache.snapshot()[1:]} == {None, "a"}
    _, held = cache._match([1, 2, 3], "a")
    cache.lock(held)
    cache.evict(100)
    assert cache._match([1, 2, 3], "a").indices.tolist() == media.tolist()
    assert len(cache._match([1, 2, 3], None).indices) == 0
    cache.unlock(held)
    assert conserved(cache, pool)
    cache.check()


def test_reset_empties(clock: FakeClock) -> None:
    cache, pool, _ = make_cache(20)
    cache.insert([1, 2, 3], pool.alloc(3))
    slots = pool.alloc(4)
    pool.free(slots[:cache.insert([1, 2, 5, 6], slots)])
    _, held = cache._match([1, 2, 5], None)
    cache.lock(held)
    cache.unlock(held)
    cache.reset()
    assert cache.node_count() == 0 and cache.total_size() == 0
    assert cache.evictable_size() == cache.protected_size() == 0
    assert cache.evicted_tokens == 0 and cache.eviction_events == 0
    assert len(cache._match([1, 2, 3], None).indices) == 0
    assert len(cache.snapshot()) == 1
    assert conserved(cache, pool)  # cached slots went back to the pool
    assert sorted(free_slots(pool)) == list(range(1, 21))
    cache.check()


def test_snapshot_lists_parents_first_with_counts() -> None:
    cache, pool, _ = make_cache(40)
    for key in ([1, 2, 3, 4], [1, 2, 5], [1, 2, 5, 6, 7], [8], [8, 9, 9, 9]):
        done = cache.insert(key, slots := pool.alloc(len(key)))
        pool.free(slots[:done])
    _, node = cache._match([1, 2, 5, 6, 7], None)
    cache.lock(node)
    rows = cache.snapshot(preview_tokens=2)
    assert rows[0]["parent"] is None and rows[0]["tokens"] == 0
    position = {row["id"]: i for i, row in enumerate(rows)}
    assert all(position[row["parent"]] < i for i, row in enumerate(rows) if i)
    assert len(rows) == cache.node_count() + 1 == 7
    by_key = {tuple(row["key_preview"]): row for row in rows[1:]}
    assert {k: r["tokens"] for k, r in by_key.items()} == {
        (1, 2): 2, (3, 4): 2, (5,): 1, (6, 7): 2, (8,): 1, (9, 9): 3}
    assert by_key[(6, 7)]["parent"] == by_key[(5,)]["id"]
    assert by_key[(5,)]["parent"] == by_key[(1, 2)]["id"]
    assert {k: r["lock_ref"] for k, r in by_key.items()} == {
        (1, 2): 1, (3, 4): 0, (5,): 1, (6, 7): 1, (8,): 0, (9, 9): 0}
    assert sum(row["tokens"] for row in rows) == cache.total_size() == 11
    full = cache.snapshot(preview_tokens=16)
    assert [row["id"] for row in full] == [row["id"] for row in rows]
    assert max(len(row["key_preview"]) for row in full) == 3
    cache.unlock(node)


def test_note_hit_counts_along_path() -> None:
    cache, pool, _ = make_cache(20)
    cache.insert([1, 2, 3, 4], pool.alloc(4))
    cache.insert([1, 2, 5], slots := pool.alloc(3))
    pool.free(slots[:2])
    _, deep = cache.match_prefix([1, 2, 3, 4, 0])
    cache.note_hit(deep)
    _, other = cache._match([1, 2, 5], None)
    cache.note_hit(other)
    cache.note_hit(cache.root)
    cache.note_hit(None)
    hits = {tuple(n.key): n.hit_count for n in cache._nodes()}
    assert hits == {(1, 2): 2, (3, 4): 1, (5,): 1}
    cache.match_prefix([1, 2, 3, 9])  # splits [3, 4]: both halves keep the count
    hits = {tuple(n.key): n.hit_count for n in cache._nodes()}
    assert hits == {(1, 2): 2, (3,): 1, (4,): 1, (5,): 1}


def test_evict_takes_least_recently_used_leaf_first(clock: FakeClock) -> None:
    cache, pool, _ = make_cache(30)
    cache.insert([1, 1, 1], pool.alloc(3))
    cache.insert([2, 2, 2], pool.alloc(3))
    cache.match_prefix([1, 1, 1, 0])  # touches the older leaf
    assert cache.evict(1) == 3
    assert len(cache._match([2, 2, 2], None).indices) == 0
    assert len(cache._match([1, 1, 1], None).indices) == 3

    cache.insert([3, 3], pool.alloc(2))
    cache.insert([4, 4], pool.alloc(2))
    cache.match_prefix([3, 3, 3])
    cache.match_prefix([1, 1, 1, 1])
    assert cache.evict(2) == 2  # [4, 4] is now least recently used
    assert {tuple(n.key) for n in cache._nodes()} == {(1, 1, 1), (3, 3)}

    _, held = cache._match([3, 3], None)
    cache.match_prefix([1, 1, 1, 1])  # [3, 3] is the LRU leaf now, but a lock keeps it
    cache.lock(held)
    assert cache.evict(1) == 3
    assert {tuple(n.key) for n in cache._nodes()} == {(3, 3)}
    assert cache.evict(10) == 0
    cache.unlock(held)
    cache.check()


def test_evict_frees_parents_once_their_children_are_gone(clock: FakeClock) -> None:
    cache, pool, _ = make_cache(30)
    for key in ([5, 5, 6], [5, 5, 7, 7], [9]):
        done = cache.insert(key, slots := pool.alloc(len(key)))
        pool.free(slots[:done])
    cache.match_prefix([9, 9])  # [9] is the newest leaf
    assert cache.evict(3) == 3  # [6] then [7, 7]: asked for 3, a whole leaf is never split
    assert {tuple(n.key) for n in cache._nodes()} == {(5, 5), (9,)}
    assert cache.evict(1) == 2  # the parent is now the LRU leaf
    assert cache.evict(0) == 0
    assert cache.evict(5) == 1 and cache.node_count() == 0
    assert cache.evicted_tokens == 6 and cache.eviction_events == 4
    assert conserved(cache, pool) and pool.available() == 30


def test_common_prefix_length_matches_a_plain_scan():
    import random

    from lmnb.runtime.prefix_cache import common_prefix_length

    rng = random.Random(0)
    for _ in range(300):
        n = rng.choice([0, 1, 7, 64, 65, 500, 1540])
        a = [rng.randrange(3) for _ in range(n)]
        b = a[:rng.randint(0, n)] + [rng.randrange(3) for _ in range(rng.randint(0, 300))]
        pairs = enumerate(zip(a, b, strict=False))
        expected = next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))
        assert common_prefix_length(a, b) == expected
        assert common_prefix_length(b, a) == expected


def test_shared_prefixes_of_handles_deep_in_a_long_chain_of_nodes() -> None:
    """Each turn of a long conversation extends the last key: one node more down one chain.
    The depths are summed without recursion (a chain of 1,500 nodes raised RecursionError)."""
    cache, pool, _ = make_cache(1600)
    key: list[int] = []
    for k in range(1500):
        key.append(3 + k)
        cache.insert(key, torch.cat((torch.zeros(len(key) - 1, dtype=torch.int64), pool.alloc(1))))
    for last in (1, 2):
        cache.insert(key + [last], torch.cat((torch.zeros(len(key), dtype=torch.int64),
                                              pool.alloc(1))))
    handles = [cache.handle_of(key + [1]), cache.handle_of(key + [2]), cache.handle_of(key[:90])]
    assert cache.node_count() == 1502
    assert cache.shared_prefixes(handles[:2], 64) == [(1500, [0, 1])]
    assert cache.shared_prefixes([handles[0], handles[2]], 64) == [(90, [0, 1])]
