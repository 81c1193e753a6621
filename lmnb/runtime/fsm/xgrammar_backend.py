"""xgrammar as a second grammar backend: EBNF grammars always, regex and JSON schema with
`grammar_backend="xgrammar"`.

`XGrammarCompiler` (one per runtime) holds xgrammar's `TokenizerInfo` of the tokenizer and the
compiled grammars, cached by (kind, text); `matcher` gives each request an `XGrammarMatcher`, the
`Grammar` seam over xgrammar's pushdown-automaton `GrammarMatcher`. Masks follow lmnb's rules, not
xgrammar's: special tokens (which xgrammar reads as their literal text, e.g. `<|im_start|>`) are
never allowed, and the request's own stop ids are allowed when the text is complete
(`is_completed`) or at a dead end. Jump-forward reads `find_jump_forward_string`, cut back to
whole characters. A mask is computed once per step (no per-state cache: the automaton's states are
not enumerable), on the CPU, then copied to the device.

JSON schemas compile with the canonical layout of lmnb's own converter (`", "` and `": "`, no other
whitespace; properties not listed are not generated), so both backends accept the same texts
for the schemas both support. In that layout no valid output holds a control character (JSON
strings escape them), so JSON-schema masks also drop every token with a byte below 0x20: xgrammar
0.2.8 lets raw control characters into strings with `minLength`/`maxLength` (its issue #800),
which would make invalid JSON. (Such bounded strings cannot hold escapes in xgrammar either: they
are valid JSON without quotes or backslashes.)
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import xgrammar

from lmnb.runtime.fsm.token_bytes import token_byte_table
from lmnb.runtime.kernels.metadata import to_device
from lmnb.runtime.sampling.bitmask import num_words, pack_mask, with_bits

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

KINDS = ("regex", "json_schema", "ebnf")
MAX_CACHED_GRAMMARS = 128
MAX_CACHED_BYTES = 256 << 20  # a JSON schema's compiled grammar is ~2.5 MB for a 49k vocabulary
# "[12:00:00] /project/cpp/grammar_parser.cc:820: " and "Check failed: (x) is false: " prefixes
_CPP_PREFIX = re.compile(r"^\s*\[[0-9:.]+\]\s*\S+:\d+:\s*|Check failed: \(.*?\) is false:\s*")


class InvalidGrammarError(ValueError):
    """A grammar, regex or schema that xgrammar cannot compile; the message says why."""


def _reason(error: Exception) -> str:
    text = _CPP_PREFIX.sub("", str(error)).strip()
    return " ".join(text.split()) or type(error).__name__


class XGrammarCompiler:
    """Compiles constraints for one tokenizer and model vocabulary; thread-safe."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, vocab_size: int,
                 stop_token_ids: Iterable[int] = ()) -> None:
        stops = sorted(stop_token_ids)
        self.vocab_size = vocab_size
        self.info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stops or None)
        self._compiler = xgrammar.GrammarCompiler(
            self.info, max_threads=min(8, os.cpu_count() or 1), cache_enabled=False)
        table = token_byte_table(tokenizer)[:vocab_size]
        regular = torch.zeros(vocab_size, dtype=torch.bool)
        regular[[i for i, data in enumerate(table) if data is not None]] = True
        self.regular = pack_mask(regular)  # [words]: tokens that spell text (no specials)
        regular[[i for i, data in enumerate(table) if data and min(data) < 0x20]] = False
        self.json_regular = pack_mask(regular)  # ... and hold no control character
        # (kind, text) -> (compiled grammar, its bytes), least recently used first
        self._compiled: OrderedDict[tuple[str, str], tuple[xgrammar.CompiledGrammar, int]] = (
            OrderedDict())
        self._cached_bytes = 0
        self._lock = threading.Lock()

    def compile(self, kind: str, text: str) -> xgrammar.CompiledGrammar:
        """The CompiledGrammar of an `ebnf` grammar (root rule `root`), a `regex` or a
        `json_schema` (JSON text); the most recently used are kept, at most MAX_CACHED_GRAMMARS
        and MAX_CACHED_BYTES. Raises InvalidGrammarError naming the problem."""
        key = (kind, text)
        with self._lock:
            if (hit := self._compiled.get(key)) is not None:
                self._compiled.move_to_end(key)
                return hit[0]
        try:
            if kind == "ebnf":
                compiled = self._compiler.compile_grammar(text)
            elif kind == "regex":
                compiled = self._compiler.compile_regex(text)
            elif kind == "json_schema":
                compiled = self._compiler.compile_json_schema(text, any_whitespace=False,
                                                              strict_mode=True)
            else:
                raise ValueError(f"unknown grammar kind {kind!r}; one of {KINDS}")
        except (RuntimeError, json.JSONDecodeError) as error:
            raise InvalidGrammarError(f"invalid {kind}: {_reason(error)}") from None
        size = compiled.memory_size_bytes
        with self._lock:
            if key not in self._compiled:
                self._compiled[key] = (compiled, size)
                self._cached_bytes += size
            while len(self._compiled) > 1 and (len(self._compiled) > MAX_CACHED_GRAMMARS
                                               or self._cached_bytes > MAX_CACHED_BYTES):
                _, (_, dropped) = self._compiled.popitem(last=False)
                self._cached_bytes -= dropped
        return compiled

    def matcher(self, kind: str, text: str) -> XGrammarMatcher:
        regular = self.json_regular if kind == "json_schema" else self.regular
        return XGrammarMatcher(self.compile(kind, text), regular=regular,
                               vocab_size=self.vocab_size)


class XGrammarMatcher:
    """One request's xgrammar `GrammarMatcher` behind the `Grammar` seam (see the module
    docstring). Used by one thread at a time (the request's scheduler)."""

    def __init__(self, compiled: xgrammar.CompiledGrammar, *, regular: torch.Tensor,
                 vocab_size: int) -> None:
        self._matcher = xgrammar.GrammarMatcher(compiled)
        self._regular = regular
        self._buffer = torch.zeros((1, num_words(vocab_size)), dtype=torch.int32)
        self._allowed: torch.Tensor | None = None  # regular tokens allowed next; None: stale
        self._can_continue = False
        self._dead = False
        self._bitmasks: dict[tuple[str, frozenset[int]], torch.Tensor] = {}  # of this step

    def _next_allowed(self) -> torch.Tensor:
        if self._allowed is None:
            if self._dead:
                self._buffer.zero_()
            else:
                self._matcher.fill_next_token_bitmask(self._buffer)
            self._allowed = self._buffer[0] & self._regular
            self._can_continue = bool(self._allowed.any())
        return self._allowed

    def bitmask(self, stop_ids: Iterable[int], device: torch.device | str = "cpu") -> torch.Tensor:
        stops = frozenset(stop_ids)
        key = (str(device), stops)
        if (packed := self._bitmasks.get(key)) is None:
            packed = self._next_allowed()
            if self._dead or not self._can_continue or self._matcher.is_completed():
                packed = with_bits(packed, stops)
            packed = self._bitmasks[key] = to_device(packed, device)
        return packed

    def _stepped(self, accepted: bool) -> None:
        self._dead = self._dead or not accepted
        self._allowed = None
        self._bitmasks.clear()

    def fork(self) -> None:
        """xgrammar's matchers cannot be copied: no speculative drafts under them."""
        return None

    def advance(self, token_id: int) -> None:
        self._stepped(not self._dead and self._matcher.accept_token(token_id))

    def advance_text(self, text: str) -> None:
        self._stepped(not self._dead and self._matcher.accept_string(text))

    @property
    def is_final(self) -> bool:
        if self._dead or not self._matcher.is_completed():
            return False
        self._next_allowed()
        return not self._can_continue

    @property
    def is_dead(self) -> bool:
        return self._dead

    def forced_text(self) -> str:
        if self._dead:
            return ""
        try:
            return self._matcher.find_jump_forward_string()
        except UnicodeDecodeError as error:  # it ends inside a character: keep the whole ones
            return bytes(error.object[:error.start]).decode("utf-8")
