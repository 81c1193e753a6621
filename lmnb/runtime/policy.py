"""Orders the waiting queue before admission: fcfs, lpm, dfs-weight, lof, and lpm with aging."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from lmnb.runtime.core import Req
from lmnb.runtime.prefix_cache import PrefixCache
from lmnb.runtime.radix.cache import RadixCache

_POLICIES: dict[str, type[SchedulePolicy]] = {}
LPM_MAX_QUEUE = 128  # beyond this many waiting requests, matching each one costs too much


def register_policy(name: str) -> Callable[[type[SchedulePolicy]], type[SchedulePolicy]]:
    def register(cls: type[SchedulePolicy]) -> type[SchedulePolicy]:
        _POLICIES[name] = cls
        cls.name = name
        return cls

    return register


class SchedulePolicy:
    """`order(waiting, cache, clock)`: the admission order; `clock` counts forward passes."""

    name = "base"

    def order(self, waiting: list[Req], cache: PrefixCache, clock: int) -> list[Req]:
        raise NotImplementedError


def _matched_lengths(waiting: list[Req], cache: PrefixCache) -> dict[int, int]:
    return {req.rid: cache.match_prefix(req.fill_ids, req.extra_key).length
            for req in waiting}


@register_policy("fcfs")
class FirstComeFirstServed(SchedulePolicy):
    def order(self, waiting: list[Req], cache: PrefixCache, clock: int) -> list[Req]:
        return list(waiting)


def _batch_order(req: Req) -> tuple[int, int]:
    """Arrival order, except that requests that arrived together (between the same two forward
    passes: one `generate` of many prompts, one `run_batch`) go longest output first: their
    caller waits for all of them, and a long one started late would decode alone at the end."""
    return req.arrival_pass, -req.sampling_params.max_new_tokens


@register_policy("lpm")
class LongestPrefixMatch(SchedulePolicy):
    """Longest cached prefix first (the paper's cache-aware order); ties, and queues too long to
    match, in `_batch_order`."""

    def order(self, waiting: list[Req], cache: PrefixCache, clock: int) -> list[Req]:
        if not cache.reuses_kv or len(waiting) > LPM_MAX_QUEUE:
            return sorted(waiting, key=_batch_order)
        matched = _matched_lengths(waiting, cache)
        return sorted(waiting, key=lambda req: (-matched[req.rid], *_batch_order(req)))


@register_policy("lof")
class LongestOutputFirst(SchedulePolicy):
    """Most new tokens to generate first (`max_new_tokens`; ties keep arrival order), SGLang's
    `lof`: the long requests of a batch start early, so fewer decode alone at its end."""

    def order(self, waiting: list[Req], cache: PrefixCache, clock: int) -> list[Req]:
        return sorted(waiting, key=lambda req: -req.sampling_params.max_new_tokens)


@register_policy("dfs-weight")
class DepthFirstWeight(SchedulePolicy):
    """Walks the radix tree depth first, heavier subtrees (more waiting requests) first, so that
    requests sharing a subtree run together while it is cached; as SGLang's, a node's own
    requests come after its subtrees' (those matching nothing cached go last)."""

    def order(self, waiting: list[Req], cache: PrefixCache, clock: int) -> list[Req]:
        if not isinstance(cache, RadixCache) or len(waiting) > LPM_MAX_QUEUE:
            return list(waiting)
        root = cache.root
        at_node: dict[int, list[Req]] = defaultdict(list)
        nodes = {}
        for req in waiting:
            node = cache.match_prefix(req.fill_ids, req.extra_key).handle
            at_node[node.id].append(req)
            nodes[node.id] = node
        weight: dict[int, int] = defaultdict(int)
        for node_id, reqs in at_node.items():
            node = nodes[node_id]
            while node is not None:
                weight[node.id] += len(reqs)
                node = node.parent
        ordered: list[Req] = []
        stack = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:  # its subtrees are done
                ordered.extend(at_node.get(node.id, ()))
                continue
            stack.append((node, True))
            children = [c for c in node.children.values() if weight.get(c.id)]
            stack.extend((child, False) for child in  # heaviest popped first
                         sorted(children, key=lambda c: weight[c.id]))
        return ordered


@register_policy("lpm-fair")
class LongestPrefixMatchWithAging(SchedulePolicy):
    """LPM, except that a request waiting `max_wait_passes` forward passes or more goes first
    (oldest first): cache-aware order without unbounded starvation."""

    def __init__(self, max_wait_passes: int = 64) -> None:
        self.max_wait_passes = max_wait_passes
        self._lpm = LongestPrefixMatch()

    def order(self, waiting: list[Req], cache: PrefixCache, clock: int) -> list[Req]:
        starved = [r for r in waiting if clock - r.arrival_pass >= self.max_wait_passes]
        rest = [r for r in waiting if clock - r.arrival_pass < self.max_wait_passes]
        return sorted(starved, key=lambda r: r.arrival_pass) + self._lpm.order(rest, cache, clock)


def make_policy(name: str) -> SchedulePolicy:
    if name not in _POLICIES:
        raise ValueError(f"unknown schedule_policy {name!r}; available: {sorted(_POLICIES)}")
    return _POLICIES[name]()
