"""A test harness: the scheduler stepped by hand over a (tiered) radix cache, a runner that checks
every prefix row it reads holds the KV of exactly that prefix and writes each new token's KV as
a function of its prefix; random prompts sharing prefixes, aborts, pins, flushes; a set-based
slot audit after every operation."""

from __future__ import annotations

import random

import torch

from lmnb.runtime.core import Req, SamplingParams, StepOutput
from lmnb.runtime.hicache.host_pool import HostKVPool
from lmnb.runtime.memory import KVAllocator, KVStorage, ReqToTokenPool
from lmnb.runtime.pins import PrefixPins
from lmnb.runtime.policy import make_policy
from lmnb.runtime.radix.cache import RadixCache
from lmnb.runtime.radix.tiered import TieredRadixCache
from lmnb.runtime.scheduler import CacheManager, ReqState, Scheduler, SchedulerConfig, StopRules

CPU = torch.device("cpu")
EOS = 2
LAYERS = 2
POISON = -777.0


def code(tokens: list[int]) -> float:
    return float(hash(tuple(tokens)) % (1 << 20))


class CheckingRunner:
    def __init__(self, kv: KVStorage, table: torch.Tensor, reqs: dict[int, Req], rng) -> None:
        self.kv, self.table, self.reqs, self.rng = kv, table, reqs, rng
        self.fail_rate = 0.0
        self.failures = 0
        self.wrong: list[str] = []
        self.sampled: dict[int, int] = {}
        self.last_failed = False
        self.check = True
        self.passes = 0

    def run(self, batch, rows):
        out = self._launch(batch)
        if isinstance(out, Exception):
            raise out
        return out

    def launch(self, batch, rows):
        out = self._launch(batch)

        class Pending:
            def result(self):
                if isinstance(out, Exception):
                    raise out
                return out

        return Pending()

    def _launch(self, batch):
        """Everything happens at launch, as stream order has it on a device: reads of the prefix
        rows, the writes of the new rows, the sampling (a following pass's input token is the
        token sampled by the launch before)."""
        self.passes += 1
        kv = self.kv
        after_failure, self.last_failed = self.last_failed, False
        if self.fail_rate and self.rng.random() < self.fail_rate:
            self.failures += 1
            self.last_failed = True
            for layer in range(LAYERS):  # what a failed pass leaves is indeterminate
                kv.k_buffers[layer][batch.out_cache_loc] = POISON
            return RuntimeError("device fault")
        for layer in range(LAYERS):
            kv.ready(layer)
        new_codes = []
        for i, rid in enumerate(batch.rids):
            req = self.reqs[rid]
            prefix = batch.prefix_lens[i]
            ids = req.fill_ids
            if prefix + batch.extend_lens[i] > len(ids):
                ids = ids + [self.sampled[rid]]
            slots = self.table[batch.req_pool_indices[i], :prefix]
            if self.check:
                for layer in range(LAYERS):
                    got = kv.k_buffers[layer][slots][:, 0, 0]
                    want = torch.tensor([code(ids[:p + 1]) + layer for p in range(prefix)])
                    if not torch.equal(got, want):
                        if after_failure:  # voided by the scheduler: reads the failed pass's
                            for layer in range(LAYERS):  # rows; its own are indeterminate
                                kv.k_buffers[layer][batch.out_cache_loc] = POISON
                            return StepOutput.empty(batch.size)
                        bad = (got != want).nonzero().flatten().tolist()
                        self.wrong.append(
                            f"req {rid} reads wrong KV at positions {bad} of its {prefix}-token "
                            f"prefix (slots {slots[bad].tolist()})")
                        raise WrongKV(self.wrong[-1])
            for p in range(prefix, prefix + batch.extend_lens[i]):
                new_codes.append(code(ids[:p + 1]))
        codes = torch.tensor(new_codes).view(-1, 1, 1)
        for layer in range(LAYERS):
            kv.k_buffers[layer][batch.out_cache_loc] = codes + layer
            kv.v_buffers[layer][batch.out_cache_loc] = -codes - layer
        out = StepOutput.empty(batch.size)
        for i, samples in enumerate(batch.samples):
            if samples:
                token = EOS if self.rng.random() < 0.1 else self.rng.randrange(3, 7)
                self.sampled[batch.rids[i]] = token
                out.next_token_ids[i] = token
                out.next_token_logprobs[i] = -1.0
        return out


class WrongKV(AssertionError):
    pass


class Sink:
    def put(self, events) -> None:
        pass


class World:
    def __init__(self, seed: int, *, tiered: bool = True, write_through: bool = False,
                 pool: int = 48, host: int = 40, max_reqs: int = 5, chunk: int = 16,
                 overlap: bool = False, fail_rate: float = 0.0, max_new: int = 8) -> None:
        self.max_new = max_new
        self.rng = random.Random(seed)
        self.kv = KVStorage(pool, num_layers=LAYERS, kv_heads=1, head_dim=2,
                            dtype=torch.float32, device=CPU)
        self.allocator = KVAllocator(pool, CPU)
        if tiered:
            self.cache = TieredRadixCache(self.allocator, HostKVPool(host, self.kv),
                                          write_through=write_through)
        else:
            self.cache = RadixCache(self.allocator)
        self.pins = PrefixPins(self.cache)
        self.manager = CacheManager(self.cache, self.allocator, ReqToTokenPool(max_reqs, 256, CPU),
                                    self.pins)
        self.reqs: dict[int, Req] = {}
        self.runner = CheckingRunner(self.kv, self.manager.table, self.reqs, self.rng)
        self.scheduler = Scheduler(
            runner=self.runner, cache=self.manager, policy=make_policy("lpm"),
            config=SchedulerConfig(chunked_prefill_size=chunk, check_integrity_each_step=True,
                                   in_batch_prefix_min_tokens=4, overlap_schedule=overlap),
            stop_rules=StopRules({EOS}), sink=Sink())
        self.runner.fail_rate = fail_rate
        self.pin_ids: list[int] = []
        self.bases = [[self.rng.randrange(3, 7) for _ in range(self.rng.randrange(6, 30))]
                      for _ in range(3)]
        self.states: list[ReqState] = []
        self.out_of_slots = 0
        self.stalls = 0

    # ---- operations ----------------------------------------------------------------------------
    def prompt(self) -> list[int]:
        base = self.rng.choice(self.bases)
        cut = self.rng.randrange(1, len(base) + 1)
        tail = [self.rng.randrange(3, 7) for _ in range(self.rng.randrange(0, 8))]
        return [1] + base[:cut] + tail

    def add(self) -> None:
        ids = self.prompt()[:self.allocator.size - 2]  # the context length is at most the pool
        new = min(self.rng.randrange(0, self.max_new), self.allocator.size - len(ids))
        req = Req(origin_input_ids=ids, sampling_params=SamplingParams(max_new_tokens=new))
        self.reqs[req.rid] = req
        state = ReqState(req)
        self.states.append(state)
        self.scheduler.add(state)

    def abort(self) -> None:
        live = [s for s in self.states if s.req.finished_reason is None]
        if live:
            self.scheduler.abort(self.rng.choice(live).rid)

    def pin(self) -> None:
        done = [s.req for s in self.states if s.req.finished_reason is not None]
        if not done:
            return
        req = self.rng.choice(done)
        ids = req.origin_input_ids[:self.rng.randrange(1, len(req.origin_input_ids) + 1)]
        pin_id = self.pins.pin(ids)
        if pin_id is not None:
            self.pin_ids.append(pin_id)

    def unpin(self) -> None:
        if self.pin_ids:
            pin_id = self.pin_ids.pop(self.rng.randrange(len(self.pin_ids)))
            assert self.pins.unpin(pin_id)

    def flush(self) -> bool:
        """Runtime.flush_cache's body."""
        if self.scheduler.has_work:
            return False
        self.cache.drop_unlocked()
        if not self.pins:
            self.cache.reset()
        return True

    # ---- audits --------------------------------------------------------------------------------
    def audit(self) -> None:
        assert not self.runner.wrong, self.runner.wrong[0]
        self.scheduler.check_integrity()
        size = self.allocator.size
        free = self.allocator.free_slots().tolist()
        assert len(free) == len(set(free)), "a slot is free twice"
        where: dict[int, str] = {s: "free" for s in free}
        for node in self.cache._nodes():
            if node.value is None:
                continue
            for s in node.value.tolist():
                assert s not in where, f"slot {s}: in tree node {node.id} and {where[s]}"
                where[s] = f"node {node.id}"
        table = self.manager.table
        for req in self.scheduler.table.live():
            for s in table[req.req_pool_idx, req.prefix_len:req.kv_len].tolist():
                assert s not in where, f"slot {s}: owned by req {req.rid} and {where[s]}"
                where[s] = f"req {req.rid}"
        missing = set(range(1, size + 1)) - set(where)
        assert not missing, f"slots leaked: {sorted(missing)}"
        assert set(where) == set(range(1, size + 1)), "a slot out of range"
        holders = [req.cache_handle for req in self.scheduler.table.live()]
        holders += [pin.handle for pin in self.pins._pins.values()]
        expected: dict[int, int] = {}
        for node in holders:
            while node is not None and node is not self.cache.root:
                expected[node.id] = expected.get(node.id, 0) + 1
                node = node.parent
        for node in self.cache._nodes():
            assert node.lock_ref == expected.get(node.id, 0), \
                f"node {node.id} lock_ref {node.lock_ref}, held by {expected.get(node.id, 0)}"
        for pin in self.pins._pins.values():
            node = pin.handle
            assert node.lock_ref > 0 and node.value is not None
            while node is not self.cache.root:
                assert node.parent is not None and \
                    node.parent.children.get((node.namespace, node.key[0])) is node, \
                    "a pinned node left the tree"
                node = node.parent

    def step(self) -> bool:
        return self.scheduler.step()

    def drain(self) -> None:
        for _ in range(2000):
            if not self.step():
                assert not self.scheduler.has_work, "idle with work left"
                break
            self.audit()
        else:
            raise AssertionError("the scheduler did not finish")
        for state in self.states:
            assert state.req.finished_reason is not None and state.req.req_pool_idx is None


def random_run(seed: int, steps: int = 200, **options) -> World:
    world = World(seed, **options)
    rng = world.rng
    for _ in range(steps):
        r = rng.random()
        if r < 0.35:
            world.add()
        elif r < 0.42:
            world.abort()
        elif r < 0.48:
            world.pin()
        elif r < 0.53:
            world.unpin()
        elif r < 0.56:
            world.flush()
        world.audit()
        world.step()
        world.audit()
    world.drain()
    while world.pin_ids:
        world.unpin()
    assert world.flush()
    world.audit()
    assert world.allocator.available() == world.allocator.size, \
        f"{world.allocator.size - world.allocator.available()} slots not back after flush"
    return world
