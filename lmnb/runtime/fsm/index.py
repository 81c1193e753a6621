"""Token-level index of a ByteFSM: which tokens may come next from each state.

A token is allowed from `state` when walking its bytes keeps the (trim) FSM alive, i.e. the text
so far plus the token is still a prefix of some match. The vocabulary is a byte trie built once per
tokenizer; a state's mask is one breadth-first walk of the trie that carries (trie node, FSM state)
pairs level by level in numpy and drops a pair as soon as its byte has no transition, so the work
is the number of live trie nodes, not vocabulary x token length. Masks are memoized per state and
shared by every request that uses the same (regex, tokenizer).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lmnb.runtime.fsm.jump import CompressedFSM
from lmnb.runtime.fsm.regex import ByteFSM, compile_regex
from lmnb.runtime.fsm.token_bytes import token_byte_table
from lmnb.runtime.kernels.metadata import to_device
from lmnb.runtime.sampling.bitmask import pack_mask

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_BATCH = 64  # FSM states walked together by build_all
MAX_CACHED_INDEXES = 128


class VocabTrie:
    """The token byte strings as a trie stored level by level.

    Level d holds the distinct d-byte prefixes in sorted order: `byte[d]` is a node's last byte,
    and the children of node i of level d are nodes child_start[d][i] : child_start[d][i + 1] of
    level d + 1. Tokens ending at level d: `end_token[d]` at nodes `end_node[d]` (several tokens may
    share bytes, e.g. SentencePiece's `▁` and `<0x20>`).
    """

    def __init__(self, table: Sequence[bytes | None]) -> None:
        self.vocab_size = len(table)
        by_bytes: dict[bytes, list[int]] = {}
        for ident, data in enumerate(table):
            if data:
                by_bytes.setdefault(data, []).append(ident)
        parents: list[list[int]] = [[]]
        bytes_: list[list[int]] = [[]]
        ends: list[list[tuple[int, int]]] = [[]]
        path = [0]  # node index per level along the previous string
        prev = b""
        for data in sorted(by_bytes):
            common = 0
            for x, y in zip(prev, data, strict=False):
                if x != y:
                    break
                common += 1
            for depth in range(common + 1, len(data) + 1):
                if depth == len(parents):
                    parents.append([])
                    bytes_.append([])
                    ends.append([])
                del path[depth:]
                path.append(len(parents[depth]))
                parents[depth].append(path[depth - 1])
                bytes_[depth].append(data[depth - 1])
            ends[len(data)].extend((path[len(data)], t) for t in by_bytes[data])
            prev = data
        self.depth = len(parents) - 1
        self.byte = [np.asarray(b, dtype=np.int64) for b in bytes_]
        sizes = [1] + [len(p) for p in parents[1:]]
        self.child_start = [
            np.searchsorted(np.asarray(parents[d + 1], dtype=np.int64), np.arange(sizes[d] + 1))
            for d in range(self.depth)
        ]
        self.end_node = [np.asarray([n for n, _ in e], dtype=np.int64) for e in ends]
        self.end_token = [np.asarray([t for _, t in e], dtype=np.int64) for e in ends]
        self.num_nodes = sum(sizes)

    def walk(self, table: np.ndarray, states: np.ndarray) -> tuple[np.ndarray, np.ndarray,
                                                                   np.ndarray]:
        """Walks every token from each of `states` through the FSM `table` ([S + 1, 256], last row
        dead). Returns (origin index, token id, end state) for every token that stays alive."""
        dead = table.shape[0] - 1
        origin = np.arange(len(states), dtype=np.int64)
        node = np.zeros(len(states), dtype=np.int64)
        state = np.asarray(states, dtype=np.int64)
        out_origin, out_token, out_state = [], [], []
        for d in range(self.depth):
            start = self.child_start[d]
            first, count = start[node], start[node + 1] - start[node]
            total = int(count.sum())
            if total == 0:
                break
            pair = np.repeat(np.arange(len(node)), count)
            child = first[pair] + np.arange(total) - np.repeat(np.cumsum(count) - count, count)
            nxt = table[state[pair], self.byte[d + 1][child]]
            live = nxt != dead
            origin, node, state = origin[pair[live]], child[live], nxt[live]
            ends = self.end_node[d + 1]
            if len(ends) and len(node):
                # tokens ending at this level whose node is live for some origin
                order = np.argsort(node, kind="stable")
                lo = np.searchsorted(node[order], ends, "left")
                hi = np.searchsorted(node[order], ends, "right")
                n = hi - lo
                if n.any():
                    idx = order[np.repeat(lo, n) + np.arange(int(n.sum()))
                                - np.repeat(np.cumsum(n) - n, n)]
                    out_origin.append(origin[idx])
                    out_token.append(np.repeat(self.end_token[d + 1], n))
                    out_state.append(state[idx])
        if not out_origin:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty
        return np.concatenate(out_origin), np.concatenate(out_token), np.concatenate(out_state)


class TokenIndex:
    """Allowed-token masks and token transitions of one regex over one tokenizer's vocabulary.

    States are ByteFSM states; the caller keeps one per request, starting at `initial`. EOS and
    other stop tokens are never in a mask (special tokens have no bytes): allow them when
    `is_accepting(state)`, and finish when `is_final(state)` (nothing else can follow).
    Thread-safe; masks are shared CPU tensors that callers must not modify.
    """

    def __init__(self, fsm: ByteFSM, table: Sequence[bytes | None], trie: VocabTrie, *,
                 vocab_size: int | None = None) -> None:
        self.fsm = fsm
        self.table = table
        self.trie = trie
        self.vocab_size = max(vocab_size or 0, len(table))
        self.compressed = CompressedFSM(fsm)
        self._masks: dict[int, torch.Tensor] = {}
        self._device_masks: dict[tuple[int, str], torch.Tensor] = {}
        self._bitmasks: dict[tuple[int, str], torch.Tensor] = {}
        self._successors: dict[int, frozenset[int]] = {}
        self._lock = threading.Lock()

    @property
    def initial(self) -> int:
        return self.fsm.initial

    def is_accepting(self, state: int) -> bool:
        return state in self.fsm.accepting

    def is_final(self, state: int) -> bool:
        """Accepting with no way to continue: the output is complete."""
        return state in self.fsm.accepting and not self.fsm.transitions[state]

    def next_state(self, state: int, token_id: int) -> int:
        """The state after `token_id`, or -1 when the token is not allowed from `state`."""
        data = self.table[token_id] if 0 <= token_id < len(self.table) else None
        return -1 if data is None or state < 0 else self.fsm.walk(state, data)

    def can_continue(self, state: int) -> bool:
        """Some token is allowed from `state` (memoized with its mask; False for -1)."""
        if not 0 <= state < self.fsm.num_states:
            return False
        if (successors := self._successors.get(state)) is None:
            self._compute([state])
            successors = self._successors[state]
        return bool(successors)

    def forced_bytes(self, state: int) -> bytes:
        """The bytes every continuation from `state` starts with (see CompressedFSM)."""
        return self.compressed.forced_bytes(state)

    def allowed(self, state: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Bool mask [vocab_size] of the tokens allowed from `state` (all False for -1), on the
        CPU or, cached per device, on `device`."""
        mask = self._masks.get(state)
        if mask is None:
            if not 0 <= state < self.fsm.num_states:
                return torch.zeros(self.vocab_size, dtype=torch.bool, device=device)
            self._compute([state])
            mask = self._masks[state]
        if device is None or torch.device(device).type == "cpu":
            return mask
        key = (state, str(device))
        if (moved := self._device_masks.get(key)) is None:
            moved = self._device_masks[key] = to_device(mask, device)
        return moved

    def bitmask(self, state: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Packed int32 [ceil(vocab_size / 32)] form of `allowed(state)` (see
        lmnb.runtime.sampling.bitmask), cached per (state, device); callers must not modify it."""
        key = (state, str(device))
        if (packed := self._bitmasks.get(key)) is None:
            packed = to_device(pack_mask(self.allowed(state)), device)
            with self._lock:
                packed = self._bitmasks.setdefault(key, packed)
        return packed

    def build_all(self) -> int:
        """Computes the mask of every state reachable from `initial` by tokens; returns how many."""
        seen = {self.initial}
        frontier = [self.initial]
        while frontier:
            todo = [s for s in frontier if s not in self._successors]
            for i in range(0, len(todo), _BATCH):
                self._compute(todo[i:i + _BATCH])
            nxt = []
            for s in frontier:
                for t in self._successors[s]:
                    if t not in seen:
                        seen.add(t)
                        nxt.append(t)
            frontier = nxt
        return len(seen)

    @property
    def num_computed(self) -> int:
        return len(self._masks)

    def _compute(self, states: list[int]) -> None:
        with self._lock:
            states = [s for s in states if s not in self._masks]
            if not states:
                return
            origin, token, end = self.trie.walk(self.fsm.table, np.asarray(states))
            masks = np.zeros((len(states), self.vocab_size), dtype=np.bool_)
            masks[origin, token] = True
            order = np.argsort(origin, kind="stable")
            bounds = np.searchsorted(origin[order], np.arange(len(states) + 1))
            for i, s in enumerate(states):
                self._successors[s] = frozenset(np.unique(end[order[bounds[i]:bounds[i + 1]]])
                                                .tolist())
                self._masks[s] = torch.from_numpy(masks[i])


_tries: weakref.WeakKeyDictionary[Any, VocabTrie] = weakref.WeakKeyDictionary()
_indexes: OrderedDict[tuple[str, int, int], tuple[weakref.ref[Any], TokenIndex]] = OrderedDict()
_lock = threading.Lock()


def vocab_trie(tokenizer: PreTrainedTokenizerBase) -> VocabTrie:
    """The byte trie of `tokenizer`'s vocabulary, built once per tokenizer object."""
    table = token_byte_table(tokenizer)
    with _lock:
        trie = _tries.get(tokenizer)
        if trie is None or trie.vocab_size != len(table):
            trie = _tries[tokenizer] = VocabTrie(table)
        return trie


def get_token_index(pattern: str, tokenizer: PreTrainedTokenizerBase, *,
                    vocab_size: int | None = None) -> TokenIndex:
    """The shared TokenIndex of (pattern, tokenizer); masks are padded to `vocab_size` (e.g. the
    model's logits width) with False. The last MAX_CACHED_INDEXES are kept. Raises
    InvalidRegexError for a bad pattern."""
    key = (pattern, id(tokenizer), vocab_size or 0)
    with _lock:
        hit = _indexes.get(key)
        if hit is not None and hit[0]() is tokenizer:
            _indexes.move_to_end(key)
            return hit[1]
    fsm = compile_regex(pattern)
    table = token_byte_table(tokenizer)
    index = TokenIndex(fsm, table, vocab_trie(tokenizer), vocab_size=vocab_size)
    with _lock:
        hit = _indexes.get(key)
        if hit is not None and hit[0]() is tokenizer:
            return hit[1]
        for stale in [k for k, (ref, _) in _indexes.items() if ref() is None]:
            del _indexes[stale]
        _indexes[key] = (weakref.ref(tokenizer), index)
        while len(_indexes) > MAX_CACHED_INDEXES:  # least recently used first
            _indexes.popitem(last=False)
        return index
