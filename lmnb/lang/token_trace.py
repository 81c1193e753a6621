"""`TokenTrace`: every token of a program's requests with where it came from, for `TokenView`.

A program run with the trace on (`Program.run(..., token_view=True)`, `%%lmprogram --tokens`)
gives each executor a `TokenTrace`; its backend (`LocalBackend`) asks the runtime for token
origins and logprobs on every gen (`return_token_origins`) and feeds each streamed chunk into
the gen's `GenRecord`. A fork's trace starts with its parent's records.

An executor's tokens (`TokenTrace.cells()`) are its gens' requests laid end to end: a later
request's prompt holds the text before it (usually as the same ids) and the new literal text;
the tokens shown so far keep their origin (an earlier gen's output stays `generated` though the
cache served it to this request), and only the prompt's ids after that text are new cells,
`cached` or `computed` as the runtime served them. Where the prompt re-tokenized the end of the
earlier text (a sampled word merged with the literal text after it), the cut is the last byte
offset where both tokenizations have a boundary. Then come the request's output ids
(`generated`, `jump_forward`, `speculated`) with their logprobs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lmnb.runtime.output.token_origins import (
    CACHED,
    COMPUTED,
    GENERATED,
    JUMP_FORWARD,
    ORIGINS,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TRACE_TOP_K = 5  # alternatives per generated token a traced gen asks for (at least)
ORIGIN_INDEX = {name: i for i, name in enumerate(ORIGINS)}

TopK = list[tuple[float, int]]
# One token of a row: [id, origin index, logprob or None, top-k or None]
Cell = list[Any]


def traced_top_k(top_logprobs_num: int | None, traced: bool) -> int | None:
    """The `top_logprobs_num` a gen's request asks for: at least `TRACE_TOP_K` when traced."""
    return max(top_logprobs_num or 0, TRACE_TOP_K) if traced else top_logprobs_num


def _common_prefix(a: Sequence[Any], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i][0] != b[i]:
            return i
    return n


class TraceLog:
    """What the traces of one program run share: a lock, a change counter with listeners (a
    view's throttle), the clock of the run and the decoder of token texts."""

    def __init__(self, token_text: Callable[[int], str],
                 token_bytes: Callable[[int], int] | None = None) -> None:
        self.lock = threading.Lock()
        self.token_text = token_text
        # UTF-8 bytes of text a token id stands for (aligns re-tokenized prompts)
        self.token_bytes = token_bytes or (lambda token: len(token_text(token).encode()))
        self.version = 0
        self.started_at = time.perf_counter()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.listeners: list[Callable[[], None]] = []  # views of the run (told of changes)

    def changed(self, *, tokens: bool = False) -> None:
        """Called under no lock after a record changed."""
        if tokens:
            now = time.perf_counter()
            if self.first_token_at is None:
                self.first_token_at = now
            self.last_token_at = now
        self.version += 1
        for listener in list(self.listeners):
            listener()


@dataclass
class GenRecord:
    """One traced request (a gen's first sample): its prompt ids and what the runtime reported.
    Updated from the backend's thread; read under `log.lock`."""

    log: TraceLog
    prompt_ids: list[int]
    prompt_chars: int  # length of the prompt text (where the gen's text starts)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    tops: list[TopK | None] = field(default_factory=list)
    output_origins: list[Any] = field(default_factory=list)  # (origin, start, end) spans
    cached_tokens: int = 0
    text_chars: int = 0  # length of the gen's text so far
    meta: dict[str, Any] | None = None  # the final meta_info
    done: bool = False
    # The output as cells, kept up to date: a cell's list is the same object from one read to
    # the next until its position is streamed again (views memoize by identity).
    _cells: list[Cell] = field(default_factory=list)
    _prompt_cells: tuple[tuple[int, int], list[Cell]] | None = None  # ((start, cached), cells)

    def update(self, chunk: dict[str, Any], text_chars: int) -> None:
        """One streamed chunk of the request (`return_token_origins` meta_info); `text_chars`:
        the gen's text length after it."""
        meta = chunk["meta_info"]
        new_ids = chunk["output_ids"]
        with self.log.lock:
            at = meta.get("output_ids_from", len(self.output_ids))
            del self.output_ids[at:], self.logprobs[at:], self.tops[at:]
            self.output_ids.extend(new_ids)
            new_logprobs = meta.get("new_token_logprobs") or [(None,)] * len(new_ids)
            self.logprobs.extend(pair[0] for pair in new_logprobs)
            new_tops = meta.get("new_top_logprobs")
            self.tops.extend(new_tops if new_tops is not None else [None] * len(new_ids))
            if "output_token_origins" in meta:
                self.output_origins = meta["output_token_origins"]
            if "cached_tokens" in meta:
                self.cached_tokens = meta["cached_tokens"]
            self.text_chars = text_chars
            if meta.get("finish_reason") is not None:
                self._finish(meta)
                at = 0  # logprobs and spans are the final ones now
            self._relay(at)
        self.log.changed(tokens=bool(new_ids))

    def _relay(self, at: int) -> None:
        """Rebuilds the cells from output position `at` on (the positions before keep their
        origin: a jump only changes the tail it re-tokenized)."""
        del self._cells[at:]
        index = {origin: ORIGIN_INDEX[origin] for origin in ORIGIN_INDEX}
        for i in range(at, len(self.output_ids)):
            self._cells.append([self.output_ids[i], index[self.origin_at(i)], self.logprobs[i],
                                self.tops[i]])

    def _finish(self, meta: dict[str, Any]) -> None:
        self.meta = meta
        ids = self.output_ids
        reason = meta["finish_reason"]
        matched = reason.get("matched") if isinstance(reason, dict) else None
        if (isinstance(matched, int) and not isinstance(matched, bool) and ids
                and ids[-1] == matched):
            ids.pop()  # a stop id is not part of the text
        n = len(ids)
        if "output_token_logprobs" in meta:
            self.logprobs = [p[0] for p in meta["output_token_logprobs"][:n]]
        if "output_top_logprobs" in meta:
            self.tops = [row or None for row in meta["output_top_logprobs"][:n]]
        del self.logprobs[n:], self.tops[n:]
        self.output_origins = meta.get("output_token_origins", self.output_origins)
        self.cached_tokens = meta.get("cached_tokens", self.cached_tokens)
        self.done = True

    def close(self) -> None:
        """The gen ended without a last chunk (aborted, failed)."""
        with self.log.lock:
            self.done = True
        self.log.changed()

    def origin_at(self, position: int) -> str:
        for origin, start, end in reversed(self.output_origins):  # live: the last span
            if start <= position < end:
                return origin
        return GENERATED  # streamed ahead of its spans

    def cells(self) -> list[Cell]:
        """The output as cells (under `log.lock`; not to be changed)."""
        return self._cells

    def prompt_cells(self, start: int) -> list[Cell]:
        """The prompt's cells from position `start` on, `cached` or `computed` (kept while
        `start` and the cached count stay; under `log.lock`; not to be changed)."""
        key = (start, self.cached_tokens)
        if self._prompt_cells is None or self._prompt_cells[0] != key:
            cached, computed = ORIGIN_INDEX[CACHED], ORIGIN_INDEX[COMPUTED]
            self._prompt_cells = (key, [
                [self.prompt_ids[p], cached if p < self.cached_tokens else computed, None, None]
                for p in range(start, len(self.prompt_ids))])
        return self._prompt_cells[1]


class TokenTrace:
    """The traced gens of one executor, in order (a fork's begin with its parent's)."""

    def __init__(self, log: TraceLog, records: list[GenRecord] | None = None,
                 inherited: list[int] | None = None, *, runtime: Any = None) -> None:
        self.log = log
        self.runtime = runtime  # the runtime the gens ran on (its stats feed the metrics bar)
        self.records: list[GenRecord] = records or []
        self.inherited_ids: list[int] = inherited or []  # the parent's token ids at the fork
        self._done_cells: list[Cell] = []  # cells of the first `_done_count` records
        self._done_count = 0
        # where the running gen's prompt joins `_done_cells`: ((record, done count), alignment)
        self._running: tuple[tuple[int, int], tuple[int, int]] | None = None

    def request(self, prompt_ids: Sequence[int], prompt_chars: int) -> GenRecord:
        """A gen's request is about to be sent with these prompt ids."""
        record = GenRecord(self.log, list(prompt_ids), prompt_chars)
        with self.log.lock:
            self.records.append(record)
        self.log.changed()
        return record

    def fork(self) -> TokenTrace:
        """The trace of a branch forked now."""
        with self.log.lock:
            ids = [cell[0] for cell in self._cells()[0]]
            return TokenTrace(self.log, list(self.records), ids, runtime=self.runtime)

    def cells(self) -> list[Cell]:
        """The executor's tokens so far: [id, origin index, logprob, top-k] each."""
        with self.log.lock:
            return self._cells()[0]

    def cells_split(self) -> tuple[list[Cell], int]:
        """(cells, stable): the first `stable` cells are those of finished gens, which no later
        chunk changes (until the next gen's prompt re-tokenizes their end)."""
        with self.log.lock:
            return self._cells()

    def covered_chars(self) -> int:
        """Characters of the executor's text that the last traced gen's prompt and output span
        (text after them was written since, or is the program's last literal text)."""
        with self.log.lock:
            if not self.records:
                return 0
            last = self.records[-1]
            return last.prompt_chars + last.text_chars

    def _cells(self) -> tuple[list[Cell], int]:
        records = self.records
        # Finished records never change again: their cells are kept.
        while self._done_count < len(records) and records[self._done_count].done:
            record = records[self._done_count]
            _lay(self._done_cells, record,
                 _align(self._done_cells, record.prompt_ids, self.log.token_bytes))
            self._done_count += 1
        cells = list(self._done_cells)
        stable = len(cells)
        for i, record in enumerate(records[self._done_count:]):
            if i == 0:  # laid on the finished cells: its alignment holds until one more ends
                key = (id(record), self._done_count)
                if self._running is None or self._running[0] != key:
                    self._running = (key, _align(cells, record.prompt_ids,
                                                 self.log.token_bytes))
                alignment = self._running[1]
            else:
                alignment = _align(cells, record.prompt_ids, self.log.token_bytes)
            stable = min(stable, _lay(cells, record, alignment))
        return cells, stable


def _lay(cells: list[Cell], record: GenRecord, alignment: tuple[int, int]) -> int:
    """Appends `record`'s request to `cells` (`alignment` from `_align`): the prompt's ids
    after the text `cells` hold, then its output; returns the index before which the cells were
    there already."""
    cut, new_from = alignment
    del cells[cut:]
    cells.extend(record.prompt_cells(new_from))
    cells.extend(record.cells())
    return cut


def _align(cells: list[Cell], prompt: list[int],
           token_bytes: Callable[[int], int]) -> tuple[int, int]:
    """(cut, new_from): keep `cells[:cut]`, add the prompt's ids from `new_from` on. Where the
    prompt re-tokenized the end of the cells' text (a generated word merged with the literal
    text after it), the cut is the last byte offset where both tokenizations have a boundary."""
    keep = _common_prefix(cells, prompt)
    old_ends: dict[int, int] = {}  # byte offset (from `keep`) -> cells ending there
    at = 0
    for count, cell in enumerate(cells[keep:], start=1):
        at += token_bytes(cell[0])
        old_ends[at] = count
    end, old_count, new_count = at, 0, 0
    at = 0
    for count, token in enumerate(prompt[keep:], start=1):
        at += token_bytes(token)
        if at > end:
            break
        if at in old_ends:
            old_count, new_count = old_ends[at], count
    return keep + old_count, keep + new_count


def trace_totals(traces: Sequence[TokenTrace]) -> dict[str, Any]:
    """Sums over every traced request of a run (each counted once, forks share records)."""
    seen: dict[int, GenRecord] = {}
    for trace in traces:
        for record in trace.records:
            seen.setdefault(id(record), record)
    log = traces[0].log if traces else None
    totals = {"requests": len(seen), "prompt_tokens": 0, "cached_tokens": 0,
              "output_tokens": 0, "jump_forward_tokens": 0, "forward_passes": 0}
    if log is None:
        return totals
    with log.lock:
        for record in seen.values():
            totals["prompt_tokens"] += len(record.prompt_ids)
            totals["cached_tokens"] += record.cached_tokens
            totals["output_tokens"] += len(record.output_ids)
            totals["jump_forward_tokens"] += sum(
                min(end, len(record.output_ids)) - start
                for origin, start, end in record.output_origins if origin == JUMP_FORWARD
                and start < len(record.output_ids))
            if record.meta is not None:
                totals["forward_passes"] += record.meta.get("forward_passes", 0)
    return totals


def token_byte_counter(tokenizer: PreTrainedTokenizerBase,
                       text: Callable[[int], str]) -> Callable[[int], int]:
    """Token id -> the UTF-8 bytes it adds to the text: from the tokenizer's byte table (exact
    for pieces of a character), its text for special tokens and unknown schemes."""
    from lmnb.runtime.fsm.token_bytes import token_byte_table

    try:
        table = token_byte_table(tokenizer)
    except ValueError:  # neither byte-level BPE nor SentencePiece with byte fallback
        table = []

    def count(token: int) -> int:
        data = table[token] if 0 <= token < len(table) else None
        return len(data) if data is not None else len(text(token).encode())

    return count
