"""`PromptTokens`: a program's prompts tokenized incrementally, with exactly the ids of
tokenizing each whole prompt.

Programs send prompts that share long prefixes (a few-shot block, a conversation so far, a
fork's parent). Tokenizing costs time in proportion to the text (the pre-tokenizer's regex
dominates), so a prompt is encoded as the ids of an earlier prompt's prefix plus the encoding of
what follows, split at a *safe boundary*: a position whose left character is printable ASCII
(not a space) and whose right character is a space or a newline.

Why that is exact, for GPT-2 style byte-level BPE (`ByteLevel(use_regex=True)`, no normalizer,
SmolLM2's tokenizer): BPE merges within pre-tokens; the pre-tokenizer's regex
(`'s|'t|...| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+`) has no look-behind, and
no alternative matches a non-space character followed by whitespace (whitespace only ever
*starts* a match, or forms a match of its own), so every match ends at or before such a
boundary and the matches on each side depend only on that side's text. Added tokens (`<|im_start|>`)
are cut out before pre-tokenization; none contains whitespace (checked), so none spans a boundary.
Other tokenizers (SentencePiece's `Metaspace`, Llama-3's split regex, normalizers) are encoded
whole every time.
"""

from __future__ import annotations

import threading
import weakref
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, islice
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

# Prompts sharing their first N characters are candidates for each other, for the longest N
# of these the prompt has; the most recent few of them are compared.
_HEADS = (32, 128, 512, 2048)
_CANDIDATES = 8
_MIN_REUSE = 64  # shorter shared prefixes are encoded afresh
_MAX_ENTRIES = 512
_MAX_CHARS = 4 << 20  # of remembered prompt text (with its ids and ends: ~10-40 bytes a char)
_SCAN = 256  # characters searched back from the shared prefix's end for a safe boundary
_GIL_FREE_CHARS = 2048  # texts at least this long are tokenized with the GIL released


def _safe_left(char: str) -> bool:
    return "!" <= char <= "~"


def safe_boundary(text: str, position: int) -> bool:
    """Tokenizing `text` equals tokenizing `text[:position]` and `text[position:]` apart."""
    return (0 < position < len(text) and text[position] in " \n"
            and _safe_left(text[position - 1]))


@dataclass(frozen=True, slots=True)
class _Entry:
    text: str
    ids: tuple[int, ...]  # without the special tokens the tokenizer adds
    ends: tuple[int, ...]  # byte offset in `text` (UTF-8) where each id ends


@dataclass(frozen=True, slots=True)
class _Plan:
    """How `text` is encoded: `entry`'s first `count` ids, then those of `text[cut:]` (no
    entry: all of `text`)."""

    text: str
    entry: _Entry | None
    cut: int
    count: int

    @property
    def rest(self) -> str:
        return self.text[self.cut:]


class PromptTokens:
    """`encode(text)` equals `tokenizer.encode(text, add_special_tokens=True)`, and
    `encode_many(texts)` each of them; thread-safe."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        self.backend = tokenizer.backend_tokenizer
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._chars = 0  # total length of the remembered texts
        self._buckets: dict[tuple[int, str], OrderedDict[str, _Entry]] = {}
        self.prefix_specials, self.incremental = self._check(tokenizer)
        self._lengths: list[int] = self._token_lengths(tokenizer) if self.incremental else []
        self.reused_chars = 0  # statistics: characters not re-tokenized
        self.encoded_chars = 0

    def _check(self, tokenizer: PreTrainedTokenizerFast) -> tuple[list[int], bool]:
        """(ids the tokenizer puts before a text, whether incremental encoding is exact)."""
        backend = self.backend
        sample = "Hello world"
        plain = backend.encode(sample, add_special_tokens=False).ids
        full = backend.encode(sample, add_special_tokens=True).ids
        prefix = full[:len(full) - len(plain)]
        if full[len(prefix):] != plain:  # a suffix (an EOS) or something else: encode whole
            return [], False
        from tokenizers.pre_tokenizers import ByteLevel

        pre = backend.pre_tokenizer
        byte_level = isinstance(pre, ByteLevel) and pre.use_regex and not pre.add_prefix_space
        added = tokenizer.added_tokens_decoder.values()
        added_ok = all(not any(c.isspace() for c in token.content)
                       and not (token.lstrip or token.rstrip or token.single_word)
                       for token in added)
        return prefix, byte_level and backend.normalizer is None and added_ok

    @staticmethod
    def _token_lengths(tokenizer: PreTrainedTokenizerFast) -> list[int]:
        """UTF-8 bytes of text each id stands for: one per byte-level character; an added
        token's content as written."""
        vocab = tokenizer.backend_tokenizer.get_vocab(with_added_tokens=False)
        lengths = [0] * (max(vocab.values(), default=0) + 1)
        for token, index in vocab.items():
            lengths[index] = len(token)
        for index, added in tokenizer.added_tokens_decoder.items():
            if index >= len(lengths):
                lengths.extend([0] * (index + 1 - len(lengths)))
            lengths[index] = len(added.content.encode("utf-8"))
        return lengths

    def _encoded(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """The backend's ids of `text`. A long text goes through the batch call, which releases
        the GIL while it tokenizes (the single call holds it throughout: milliseconds for a
        few-shot prompt, in which the scheduler thread could launch nothing)."""
        if len(text) >= _GIL_FREE_CHARS:
            return self.backend.encode_batch(
                [text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def _plain(self, text: str) -> list[int]:
        return self._encoded(text, add_special_tokens=False) if text else []

    def encode(self, text: str) -> list[int]:
        if not self.incremental:
            return list(self._encoded(text, add_special_tokens=True))
        plan = self._plan(text)
        return self._finish(plan, self._plain(plan.rest))

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` of each text, what is new in them tokenized by one batch call of the
        tokenizer (which releases the GIL and spreads the texts over the cores), or two: texts
        that share their first characters with no remembered text but with another of `texts`
        (a batch's programs with one few-shot prefix) wait for the first of them, then reuse its
        ids."""
        if not self.incremental:
            return self._batch(list(texts), add_special_tokens=True)
        results: list[list[int]] = [[] for _ in texts]
        now: list[tuple[int, _Plan]] = []
        later: list[int] = []
        leaders: set[str] = set()
        for index, text in enumerate(texts):
            plan = self._plan(text)
            if plan.entry is None and len(text) >= _MIN_REUSE:
                if text[:_MIN_REUSE] in leaders:
                    later.append(index)
                    continue
                leaders.add(text[:_MIN_REUSE])
            now.append((index, plan))
        self._finish_all(now, results)
        if later:  # planned now that their group's first text is remembered
            self._finish_all([(index, self._plan(texts[index])) for index in later], results)
        return results

    def _finish_all(self, plans: list[tuple[int, _Plan]], results: list[list[int]]) -> None:
        """`results[index]` of each plan, their new text tokenized by one batch call."""
        rests = [plan.rest for _, plan in plans]
        encoded = iter(self._batch([rest for rest in rests if rest], add_special_tokens=False))
        for (index, plan), rest in zip(plans, rests, strict=True):
            results[index] = self._finish(plan, next(encoded) if rest else [])

    def _batch(self, texts: list[str], *, add_special_tokens: bool) -> list[list[int]]:
        if not texts:
            return []
        return [encoding.ids for encoding in self.backend.encode_batch(
            texts, add_special_tokens=add_special_tokens)]

    def _plan(self, text: str) -> _Plan:
        found = self._reusable(text)
        if found is None:
            return _Plan(text, None, 0, 0)
        entry, cut, count = found
        return _Plan(text, entry, cut, count)

    def _finish(self, plan: _Plan, rest: list[int]) -> list[int]:
        """The ids of `plan.text` (remembered), given those of `plan.rest`."""
        text, entry, count = plan.text, plan.entry, plan.count
        ids: tuple[int, ...]
        if entry is None:
            ids = tuple(rest)
            ends = tuple(accumulate(map(self._lengths.__getitem__, ids)))
            self.encoded_chars += len(text)
        else:  # tuples throughout: the long prefix is copied once into each
            ids = entry.ids[:count] + tuple(rest)
            rest_ends = accumulate(map(self._lengths.__getitem__, rest),
                                   initial=entry.ends[count - 1])
            next(rest_ends)  # the initial value: the prefix's own end
            ends = entry.ends[:count] + tuple(rest_ends)
            self.reused_chars += plan.cut
            self.encoded_chars += len(text) - plan.cut
        self._remember(text, ids, ends)
        return [*self.prefix_specials, *ids]

    def _reusable(self, text: str) -> tuple[_Entry, int, int] | None:
        """(entry, cut, count): `text[:cut]` is the entry's text's, tokenized as its first
        `count` ids, with `cut` a safe boundary of both texts; None when nothing long enough."""
        candidates: list[_Entry] = []
        with self._lock:
            for head in reversed(_HEADS):
                bucket = self._buckets.get((head, text[:head])) if len(text) >= head else None
                if bucket:  # the most recent first
                    candidates = list(islice(reversed(bucket.values()), _CANDIDATES))
                    break
        best: tuple[_Entry, int] | None = None
        for entry in candidates:
            if best is not None and (
                    len(entry.text) <= best[1] or entry.text[best[1]] != text[best[1]]
                    or not _shares(text, entry.text, best[1] + 1)):
                continue  # shares no more than the best so far (one character, then one slice)
            shared = _shared_prefix(text, entry.text)
            if best is None or shared > best[1]:
                best = (entry, shared)
            if shared == len(text):
                break
        if best is None:
            return None
        entry, shared = best
        for cut in range(shared, max(_MIN_REUSE, shared - _SCAN) - 1, -1):
            if safe_boundary(text, cut) and safe_boundary(entry.text, cut):
                break
        else:
            return None
        end = cut if text.isascii() else len(text[:cut].encode("utf-8"))  # isascii: O(1)
        count = bisect_left(entry.ends, end)
        if count >= len(entry.ends) or entry.ends[count] != end:
            return None  # not at a token end after all: stay exact
        return entry, cut, count + 1

    def _remember(self, text: str, ids: tuple[int, ...], ends: tuple[int, ...]) -> None:
        if len(text) < _MIN_REUSE:
            return
        entry = _Entry(text, ids, ends)
        with self._lock:
            if text in self._entries:
                self._entries.move_to_end(text)
                return
            self._entries[text] = entry
            for head in _HEADS:
                if len(text) >= head:
                    self._buckets.setdefault((head, text[:head]), OrderedDict())[text] = entry
            self._chars += len(text)
            while len(self._entries) > _MAX_ENTRIES or (self._chars > _MAX_CHARS
                                                        and len(self._entries) > 1):
                oldest, _ = self._entries.popitem(last=False)
                self._chars -= len(oldest)
                for head in _HEADS:
                    key = (head, oldest[:head])
                    bucket = self._buckets.get(key)
                    if bucket is not None:
                        bucket.pop(oldest, None)
                        if not bucket:
                            del self._buckets[key]


def _shares(a: str, b: str, count: int) -> bool:
    """Whether `a` and `b` have the same first `count` characters (one slice of `b` only)."""
    return len(b) >= count and a.startswith(b[:count] if count < len(b) else b)


def _shared_prefix(a: str, b: str) -> int:
    """Length of the common prefix of `a` and `b`: a binary search that compares only the
    window still in doubt (slices of O(len) characters in all, not O(len log len))."""
    low, high = 0, min(len(a), len(b))
    if a.startswith(b) or b.startswith(a):
        return high
    while low < high:  # a[:low] == b[:low]; the answer is in [low, high]
        middle = (low + high + 1) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle - 1
    return low


_per_tokenizer: weakref.WeakKeyDictionary[PreTrainedTokenizerFast, PromptTokens] = (
    weakref.WeakKeyDictionary())
_per_tokenizer_lock = threading.Lock()


def prompt_tokens(tokenizer: PreTrainedTokenizerBase | None) -> PromptTokens | None:
    """The shared `PromptTokens` of `tokenizer` (one per tokenizer, so every backend over a
    runtime reuses it); None for a tokenizer without a fast backend, or none."""
    if tokenizer is None:
        return None
    from transformers import PreTrainedTokenizerFast

    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return None
    with _per_tokenizer_lock:
        found = _per_tokenizer.get(tokenizer)
        if found is None:
            found = _per_tokenizer[tokenizer] = PromptTokens(tokenizer)
        return found
