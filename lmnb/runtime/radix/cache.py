"""RadixAttention's cache: a radix tree over token ids whose nodes hold KV slot indices.

    root ── [The, cat]──┬── [sat]            each edge is a run of tokens; a node's `value`
                        └── [ran, away]      holds the KV slot of each of its tokens

Cached tokens and running requests share one pool: a node is *protected* while some request holds
a lock on it or on a descendant (lock_ref > 0), else *evictable*. Eviction frees least recently
used unlocked leaves first; a parent becomes a leaf, and evictable, once its children are gone.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import torch

from lmnb.runtime.memory import KVAllocator
from lmnb.runtime.prefix_cache import (
    EvictionListener,
    MatchResult,
    PrefixCache,
    common_prefix_length,
)


class TreeNode:
    __slots__ = ("id", "parent", "children", "key", "value", "host", "lock_ref", "last_access",
                 "hit_count", "namespace")

    def __init__(self, node_id: int, namespace: Hashable = None) -> None:
        self.id = node_id
        self.parent: TreeNode | None = None
        self.children: dict[tuple[Hashable, int], TreeNode] = {}
        self.key: list[int] = []
        self.value: torch.Tensor | None = None  # device slots; None: not on the device
        self.host: torch.Tensor | None = None  # host slots of a tiered cache (radix/tiered.py)
        self.lock_ref = 0
        self.last_access = time.monotonic()
        self.hit_count = 0
        self.namespace = namespace

    def __lt__(self, other: TreeNode) -> bool:  # heap order: least recently used first
        return self.last_access < other.last_access


class RadixCache(PrefixCache):
    """Token-level radix tree of KV slots, LRU eviction, lock counting.

    Keys may live in a namespace (`extra_key`): equal token runs under different namespaces never
    share KV (e.g. LoRA adapters, or media whose pseudo-tokens must not collide).
    """

    def __init__(self, allocator: KVAllocator) -> None:
        super().__init__(allocator)
        self._ids = itertools.count()
        self.eviction_listener: EvictionListener | None = None
        self._new_tree()

    def reset(self) -> None:
        listener, self.eviction_listener = self.eviction_listener, None
        self.evict(self._evictable)  # cached slots go back to the shared pool
        if listener is not None:
            listener.reset()
        self.eviction_listener = listener
        self._new_tree()

    def _new_tree(self) -> None:
        """An empty tree: just the root; no evictions counted."""
        self.root = TreeNode(next(self._ids))
        self.root.lock_ref = 1  # the root is never evicted
        self.root.value = torch.empty(0, dtype=torch.int64, device=self.allocator.device)
        self._evictable = 0
        self._protected = 0
        self.evicted_tokens = 0
        self.eviction_events = 0

    # ---- matching --------------------------------------------------------------------------------
    def match_prefix(self, key: Sequence[int], extra_key: Hashable = None) -> MatchResult:
        if len(key) <= 1:
            return MatchResult((self.root.value,), self.root)
        return self._match(list(key[:len(key) - 1]), extra_key)

    def match_all(self, key: Sequence[int], extra_key: Hashable = None) -> MatchResult:
        return self._match(list(key), extra_key)

    def _match(self, key: list[int], extra_key: Hashable) -> MatchResult:
        node = self.root
        values = []
        now = time.monotonic()
        node.last_access = now
        for child, matched in self._edges(self.root, key, 0, extra_key):
            if child.value is None:  # no KV on the device from here on
                break
            if matched < len(child.key):
                child = self._split(child, matched)  # the unmatched lower half keeps its time
            child.last_access = now
            values.append(child.value)
            node = child
        return MatchResult(values or (self.root.value,), node)

    def _edges(self, node: TreeNode, key: Sequence[int], done: int,
               extra_key: Hashable) -> Iterator[tuple[TreeNode, int]]:
        """The edges below `node` that continue `key[done:]`, top down: (child, how many of its
        tokens the key matches). The walk ends where no child continues the key or after an
        edge the key matches only in part, so a caller may split that last edge."""
        while done < len(key):
            child = node.children.get((extra_key, key[done]))
            if child is None:
                return
            matched = common_prefix_length(child.key, key[done:])
            partial = matched < len(child.key)  # before the caller may split `child`
            yield child, matched
            if partial:
                return
            done += matched
            node = child

    def handle_of(self, key: Sequence[int], extra_key: Hashable = None) -> TreeNode:
        return self._descend(list(key), extra_key)[0]

    def _descend(self, key: list[int], extra_key: Hashable) -> tuple[TreeNode, int]:
        """Follows `key` down from the root as far as it is cached, splitting the last edge where
        the key ends or departs from it and touching the nodes passed; returns the deepest node
        reached and how many tokens of `key` lead to it."""
        node, done = self.root, 0
        now = time.monotonic()
        for child, matched in self._edges(self.root, key, 0, extra_key):
            if matched < len(child.key):
                child = self._split(child, matched)
            child.last_access = now
            done += matched
            node = child
        return node, done

    def cached_length(self, key: Sequence[int], extra_key: Hashable = None) -> int:
        return sum(matched for _, matched in self._edges(self.root, list(key), 0, extra_key))

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cuts `node`'s edge after `at` tokens; returns the new upper node."""
        upper = TreeNode(next(self._ids), node.namespace)
        upper.parent = node.parent
        upper.key = node.key[:at]
        upper.value = None if node.value is None else node.value[:at]
        upper.host = None if node.host is None else node.host[:at]
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        upper.hit_count = node.hit_count
        node.parent.children[(node.namespace, upper.key[0])] = upper
        node.key = node.key[at:]
        node.value = None if node.value is None else node.value[at:]
        node.host = None if node.host is None else node.host[at:]
        node.parent = upper
        upper.children[(node.namespace, node.key[0])] = node
        return upper

    def shared_prefixes(self, handles: Sequence[TreeNode | None],
                        min_tokens: int) -> list[tuple[int, list[int]]]:
        chains: list[list[TreeNode]] = []
        sharers: dict[TreeNode, int] = {}
        for node in handles:
            chain = []
            while node is not None and node is not self.root:
                chain.append(node)  # deepest first
                sharers[node] = sharers.get(node, 0) + 1
                node = node.parent
            chains.append(chain)
        depths: dict[TreeNode, int] = {}  # tokens from the root through the node's edge
        for chain in chains:  # summed from the root down (a deep tree: no recursion)
            total = 0
            for node in reversed(chain):
                total += len(node.key)
                depths[node] = total
        groups: dict[TreeNode, list[int]] = {}
        for row, chain in enumerate(chains):
            for node in chain:
                if sharers[node] >= 2:
                    if depths[node] >= min_tokens:
                        groups.setdefault(node, []).append(row)
                    break
        return [(depths[node], rows) for node, rows in groups.items()]

    def note_hit(self, node: TreeNode | None) -> None:
        while node is not None and node is not self.root:
            node.hit_count += 1
            node = node.parent

    # ---- inserting -------------------------------------------------------------------------------
    def insert(self, key: Sequence[int], value: torch.Tensor, extra_key: Hashable = None) -> int:
        """Adds `key` -> `value` slots; returns how many leading tokens were already cached (their
        slots in `value` are duplicates that stay the caller's)."""
        key = list(key)
        node, done = self._descend(key, extra_key)
        leaf = None
        if done < len(key):
            leaf = TreeNode(next(self._ids), extra_key)
            leaf.parent = node
            leaf.key = key[done:]
            leaf.value = value[done:].clone()
            node.children[(extra_key, key[done])] = leaf
            self._evictable += len(leaf.key)
        return self._inserted(node, done, value, leaf)

    def _inserted(self, node: TreeNode, done: int, value: torch.Tensor,
                  leaf: TreeNode | None) -> int:
        """`insert`'s last step: the key's path ends at `node`, `done` tokens in, then `leaf`
        (None: the key was in the tree whole). Returns how many leading tokens were cached. A
        tiered cache's path nodes without device KV take `value`'s slots here."""
        return done

    def insert_tail(self, key: Sequence[int], start: int, slots: torch.Tensor,
                    extra_key: Hashable = None) -> tuple[int, TreeNode]:
        """As `PrefixCache.insert_tail`, with no device work: the new leaf keeps a view of
        `slots` (one tensor per pass, copied once by the caller, serves all its leaves)."""
        key = list(key)
        node, done = self._descend(key, extra_key)
        if done < start:
            raise ValueError(f"insert_tail: only {done} of the {start} leading tokens are cached")
        if done < len(key):
            leaf = TreeNode(next(self._ids), extra_key)
            leaf.parent = node
            leaf.key = key[done:]
            leaf.value = slots[done - start:]
            node.children[(extra_key, key[done])] = leaf
            self._evictable += len(leaf.key)
            node = leaf
        return done, node

    # ---- locks -----------------------------------------------------------------------------------
    def lock(self, node: TreeNode | None) -> None:
        while node is not None and node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode | None) -> None:
        while node is not None and node is not self.root:
            if node.lock_ref == 1:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            node.lock_ref -= 1
            if node.lock_ref < 0:
                raise AssertionError(f"radix node {node.id} unlocked more often than locked")
            node = node.parent

    # ---- eviction --------------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        leaves = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            leaf = heapq.heappop(leaves)
            self.allocator.free(leaf.value)
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            parent = leaf.parent
            del parent.children[(leaf.namespace, leaf.key[0])]
            self.eviction_events += 1
            if self.eviction_listener is not None and leaf.namespace is None:
                self.eviction_listener.evicted(self._path(parent) + leaf.key[:1])
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        self.evicted_tokens += freed
        return freed

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def _path(self, node: TreeNode) -> list[int]:
        """The tokens from the root through the end of `node`'s edge."""
        edges = []
        while node is not self.root:
            edges.append(node.key)
            node = node.parent
        return [token for edge in reversed(edges) for token in edge]

    # ---- inspection ------------------------------------------------------------------------------
    def _nodes(self) -> list[TreeNode]:
        nodes, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def total_size(self) -> int:
        return sum(len(n.key) for n in self._nodes())

    def node_count(self) -> int:
        return len(self._nodes())

    def snapshot(self, preview_tokens: int = 16) -> list[dict[str, Any]]:
        """The tree as plain data, parents first; `key_preview` holds leading token ids."""
        rows = [{"id": self.root.id, "parent": None, "tokens": 0, "key_preview": [],
                 "lock_ref": 0, "last_access": self.root.last_access, "hit_count": 0,
                 "namespace": None, "tier": "device"}]
        stack = [self.root]
        while stack:
            node = stack.pop()
            for child in sorted(node.children.values(), key=lambda n: n.id):
                rows.append({"id": child.id, "parent": node.id, "tokens": len(child.key),
                             "key_preview": child.key[:preview_tokens],
                             "lock_ref": child.lock_ref, "last_access": child.last_access,
                             "hit_count": child.hit_count, "namespace": child.namespace,
                             "tier": "device"})
                stack.append(child)
        return rows

    def check_locks(self, holders: Sequence[TreeNode | None]) -> None:
        expected: dict[int, int] = {}
        for node in holders:
            while node is not None and node is not self.root:
                expected[node.id] = expected.get(node.id, 0) + 1
                node = node.parent
        for node in self._nodes():
            assert node.lock_ref == expected.get(node.id, 0), (
                f"radix node {node.id} is locked {node.lock_ref} times, held "
                f"{expected.get(node.id, 0)} times by live requests and pins")

    def check(self) -> None:
        """Self-check for tests: sizes add up, children are keyed by their first token."""
        evictable = protected = 0
        for node in self._nodes():
            assert node.key and len(node.key) == len(node.value), f"node {node.id} key/value"
            assert node.parent.children[(node.namespace, node.key[0])] is node
            assert node.lock_ref >= 0
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
            assert node.lock_ref >= max((c.lock_ref for c in node.children.values()), default=0)
        assert (evictable, protected) == (self._evictable, self._protected), \
            f"counted {(evictable, protected)} != kept {(self._evictable, self._protected)}"
