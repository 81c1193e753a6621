"""`TokenViewModel`: what a `TokenView` shows and when it updates, without a widget library.

It reads a traced program run (`Program.run(..., token_view=True)`) on a `Throttle` thread while
the program runs. Small state goes to `publish(changes)` (the widget's synced traits: `rows`
headers, `counts`, `metrics`, `metrics_html`, `done`, and `snapshot`); the tokens themselves
go to `send(message)` as deltas (the widget's custom comm messages; a headless caller, e.g. the
benchmark, serializes both as the comm would):

    {"seq": n, "base": n - 1, "rows": [[row id, cut, [token, ...]], ...]}

keeps a row's first `cut` tokens and appends the new ones. A front end that missed a delta (one
drawn after the view started sending: the kernel is busy running the cell, so it cannot ask)
catches up from `snapshot`, every row's tokens whole as JSON text with the `seq` they are at,
published on the first update, whenever the tokens shown have grown fourfold since the last
one (so snapshots add about a third of the final text in all, in a logarithmic number of updates)
and when the run is done (what saved widget state keeps); `resync()` sends the whole state as a
message with `"base": None` (asked for by a front end that missed a delta, answered once the
kernel is idle). So an update costs what changed since the last one (the running gen's new
tokens; a finished gen's tokens only where their final values differ), not the whole growing
text: a row's cells are compared with those of the last update by identity (equal values
count as unchanged), each new token is converted once, and no JSON is written per update here.
The next live update waits until the last one's time is at most `MAX_FLUSH_SHARE` of the time
since. A long conversion releases the GIL every few dozen tokens: the runtime's scheduler
releases it for every tensor op and would otherwise wait up to the interpreter's switch
interval (5 ms) each time to get it back while a view converts.
"""

from __future__ import annotations

import html
import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmnb.lang.backends.base import ProgramAborted
from lmnb.lang.interpreter import StreamExecutor
from lmnb.lang.program import ProgramState
from lmnb.lang.token_trace import Cell, TokenTrace
from lmnb.runtime.output.token_origins import ORIGINS
from lmnb.widgets.metrics import metrics_html, runtime_stats, traced_metrics
from lmnb.widgets.throttle import Throttle

# A token on the wire: [text, origin index (ORIGINS), logprob or None, [[text, logprob], ...]]
Token = list[Any]

# Tints per origin (calm; generated is drawn from its probability instead).
COLORS = {"computed": "#e5e7eb", "cached": "#bfdbfe", "generated": "#bbf7d0",
          "jump_forward": "#fde68a", "speculated": "#ddd6fe"}
LABELS = {"computed": "prompt, computed", "cached": "prompt, from cache",
          "generated": "generated", "jump_forward": "jump-forward", "speculated": "speculated"}
MAX_FLUSH_SHARE = 0.02  # a live view spends at most ~2% of the wall clock updating itself
SYNCED = ("rows", "counts", "metrics", "metrics_html", "done", "snapshot")
_SNAPSHOT_MIN = 64  # tokens shown beyond 4x the last snapshot's before the next one
_YIELD_EVERY = 32  # tokens converted between two releases of the GIL (~0.5-1 ms of work)
_JSON_CHUNK = 256  # tokens serialized between two releases of the GIL (~1 ms)


def _places3(logprob: float) -> float:
    """A logprob (<= 0) to 3 decimal places, half away from zero, at a third of `round(x, 3)`'s
    cost (a token carries six); -inf (a masked alternative) and nan as they are."""
    return int(logprob * 1000 - 0.5) / 1000 if logprob > -1e12 else logprob


def snapshot_json(seq: int, rows: list[tuple[int, list[Token]]]) -> str:
    """`json.dumps({"seq": seq, "rows": {str(id): tokens, ...}})`, serialized `_JSON_CHUNK`
    tokens at a time with the GIL released in between: a snapshot of 10,000 tokens is ~1.3 MB,
    tens of milliseconds in one `json.dumps` that the runtime's threads would wait out."""
    parts = []
    for row_id, tokens in rows:
        chunks = []
        for at in range(0, len(tokens), _JSON_CHUNK):
            chunks.append(json.dumps(tokens[at:at + _JSON_CHUNK])[1:-1])
            time.sleep(0)
        parts.append(f"{json.dumps(str(row_id))}: [{', '.join(chunks)}]")
    return f'{{"seq": {seq}, "rows": {{{", ".join(parts)}}}}}'


def generated_color(logprob: float) -> str:
    """The tint of a generated token of this logprob (the ESM's `genColor`)."""
    return f"hsl(142, 70%, {56 + 30 * math.exp(logprob):.1f}%)"


def token_title(token: Token) -> str:
    """A token's hover text: its text and origin, logprob and top alternatives."""
    text, origin, logprob, alternatives = token
    lines = [f"{text!r}  {ORIGINS[origin]}"]
    if logprob is not None:
        lines.append(f"logprob {logprob:.3f} (p={math.exp(logprob):.3f})")
    if alternatives:
        lines.append("top alternatives:")
        lines.extend(f"  {alt!r}  {alt_logprob:.3f}" for alt, alt_logprob in alternatives)
    return "\n".join(lines)


def rows_html(rows: list[tuple[dict[str, Any], list[Token]]]) -> str:
    """The rows (each with its tokens) as static HTML: a span per token with its tint and its
    hover text."""
    parts = []
    for row, tokens in rows:
        spans = []
        for token in tokens:
            origin = ORIGINS[token[1]]
            color = (generated_color(token[2]) if origin == "generated" and token[2] is not None
                     else COLORS[origin])
            spans.append(f'<span class="lmnb-tv-tok lmnb-tv-{origin}" style="background:{color};'
                         f'color:#111;border-radius:2px;margin-right:1px" '
                         f'title="{html.escape(token_title(token))}">'
                         f"{html.escape(token[0])}</span>")
        tail = (f'<span style="opacity:.6">{html.escape(row["tail"])}</span>'
                if row["tail"] else "")
        parts.append(
            f'<div class="lmnb-tv-row" style="border:1px solid #ccc;border-radius:4px;'
            f'padding:4px 6px;margin-bottom:6px"><div style="font-weight:600">'
            f'{html.escape(row["label"])} <span style="font-weight:400;font-size:11px">'
            f'{html.escape(row["status"])}</span></div><div style="white-space:pre-wrap;'
            f'font-family:monospace;font-size:12px;line-height:1.6">{"".join(spans)}{tail}'
            f"</div></div>")
    return "".join(parts)


def _status(executor: StreamExecutor) -> str:
    if isinstance(executor.error, ProgramAborted):
        return "aborted"
    if executor.error is not None:
        return "error"
    return "running" if not executor.idle and executor.alive else "done"




@dataclass
class _Row:
    """What the front end holds of one executor's trace: the cells of the last update (the
    trace's list, whole), the first `start` of which are its parent's (not shown), and the
    shown cells as tokens, counted by origin."""

    cells: list[Cell] = field(default_factory=list)
    stable: int = 0
    start: int = 0
    tokens: list[Token] = field(default_factory=list)
    counts: list[int] = field(default_factory=lambda: [0] * len(ORIGINS))


def _first_change(old: list[Cell], new: list[Cell], unchanged: int) -> int:
    """The first index where `new` differs from `old` (a cell is unchanged when it is the same
    object or equal); the first `unchanged` are the finished cells of both reads, checked in
    one comparison (by identity, in C) before the rest is walked."""
    n = min(len(old), len(new))
    at = min(unchanged, n)
    if old[:at] != new[:at]:  # a re-tokenized end of the finished text: walk from the start
        at = 0
    elif old[at:n] == new[at:n]:  # the usual case: only new tokens (the running gen's cells
        return n  # stay the same objects), found in C rather than by the walk below
    while at < n and (old[at] is new[at] or old[at] == new[at]):
        at += 1
    return at


class TokenViewModel:
    """The synced state of a view of `state`'s traced run (see the module doc).

    `rows`: one header per executor with a trace, in creation order: {id, label, status, tail};
    `tokens(row)`: the tokens it shows; `counts`: tokens shown per origin; `metrics` /
    `metrics_html`: the metrics bar; `done`: nothing runs any more; `snapshot`: every row's
    tokens as JSON text ({"seq": deltas sent, "rows": {row id: tokens}}), now and then.
    `publish(changes)` gets the fields an update changed and `send(message)` the token deltas,
    both from the updating thread (under the model's lock, so that deltas and `resync()`'s
    whole state go out in order).
    """

    def __init__(self, state: ProgramState, *, publish: Callable[[dict[str, Any]], None],
                 send: Callable[[dict[str, Any]], None] | None = None, hz: float = 10.0,
                 start: bool = True) -> None:
        trace = state.token_trace
        if trace is None:
            raise ValueError("this program run recorded no tokens: run it with "
                             "`program.run(..., token_view=True)` or `%%lmprogram --tokens`")
        self._state = state
        self._publish = publish
        self._send = send
        self._log = trace.log
        self._texts = trace.log.token_text
        self._lock = threading.Lock()
        self._closed = False
        self._version = -1
        self._next_at = 0.0  # monotonic time before which a live flush is skipped
        self._rows: dict[int, _Row] = {}
        self.seq = 0  # deltas sent
        self.rows: list[dict[str, Any]] = []
        self.counts: dict[str, int] = {}
        self.metrics: dict[str, Any] = {}
        self.metrics_html = ""
        self.done = False
        self.snapshot = ""
        self._snapshot_size = 0  # tokens shown at the last snapshot
        self.flushes = 0
        self.flush_seconds = 0.0  # time spent building and publishing updates (benchmarks)
        self.flush_cpu_seconds = 0.0  # CPU time of the updating thread in them (benchmarks)
        self._throttle: Throttle | None = None
        if start:
            self.start(hz)

    def start(self, hz: float = 10.0) -> None:
        """Reads the run now and keeps updating while it runs (at most `hz` times a second)."""
        self._throttle = Throttle(self._flush, hz=hz)
        self._log.listeners.append(self._throttle.request)
        self.refresh()
        self._throttle.request()

    # ---- rows ------------------------------------------------------------------------------
    def _traces(self) -> list[tuple[StreamExecutor, TokenTrace]]:
        return [(e, e.token_trace) for e in self._state.run.executors
                if e.token_trace is not None]

    def _convert(self, cells: list[Cell]) -> list[Token]:
        """The cells as tokens on the wire (every shown token passes here once)."""
        text = self._texts
        tokens = []
        for i, (token_id, origin, logprob, top) in enumerate(cells, start=1):
            alternatives = ([[text(alt[1]), _places3(alt[0])] for alt in top]  # (logprob, id..)
                            if top else None)
            tokens.append([text(token_id), origin,
                           None if logprob is None else _places3(logprob), alternatives])
            if i % _YIELD_EVERY == 0:
                time.sleep(0)  # lets the runtime's threads take the GIL back (see above)
        return tokens

    def _update_row(self, key: int, trace: TokenTrace) -> tuple[int, list[Token]] | None:
        """Brings row `key` up to its trace; (cut, new tokens) when what it shows changed."""
        cells, stable = trace.cells_split()
        row = self._rows.get(key)
        fresh = row is None
        if row is None:
            row = self._rows[key] = _Row()
        changed = 0 if fresh else _first_change(row.cells, cells, min(row.stable, stable))
        start = min(changed, row.start)  # the cells before are the parent's still
        inherited = trace.inherited_ids
        while start < min(len(inherited), len(cells)) and cells[start][0] == inherited[start]:
            start += 1
        cut = 0 if start != row.start else max(changed, start) - start
        row.cells, row.stable, row.start = cells, stable, start
        if not fresh and cut == len(row.tokens) and start + cut == len(cells):
            return None  # nothing shown changed (a moved start resends the row: cut 0)
        for token in row.tokens[cut:]:
            row.counts[token[1]] -= 1
        new = self._convert(cells[start + cut:])
        for token in new:
            row.counts[token[1]] += 1
        del row.tokens[cut:]
        row.tokens.extend(new)
        return cut, new

    def _header(self, index: int, executor: StreamExecutor, trace: TokenTrace) -> dict[str, Any]:
        text = executor.text_
        covered = trace.covered_chars()
        tail = text[covered:] if trace.records and covered < len(text) else ""
        if not trace.records:
            tail = text[executor.fork_point:]
        return {"id": executor.id, "label": "root" if index == 0 else f"fork {index}",
                "status": _status(executor), "tail": tail}

    def tokens(self, row: dict[str, Any]) -> list[Token]:
        """The tokens a row shows (not to be changed)."""
        shown = self._rows.get(row["id"])
        return shown.tokens if shown is not None else []

    def _whole(self) -> list[list[Any]]:
        return [[row["id"], 0, self.tokens(row)] for row in self.rows]

    # ---- updates ---------------------------------------------------------------------------
    def _flush(self) -> bool:
        if self._closed:
            return False
        if time.monotonic() < self._next_at:
            return True  # over its time budget: wait for the next turn
        self.refresh()
        return not self.done

    def refresh(self) -> None:
        """Reads the traces and publishes what changed, now."""
        with self._lock:
            started, cpu = time.perf_counter(), time.thread_time()
            version = self._log.version
            traces = self._traces()
            done = all(_status(executor) != "running" for executor, _ in traces)
            if version != self._version or done != self.done:
                rows, deltas = [], []
                for index, (executor, trace) in enumerate(traces):
                    rows.append(self._header(index, executor, trace))
                    delta = self._update_row(executor.id, trace)
                    if delta is not None:
                        deltas.append([executor.id, *delta])
                total = [0] * len(ORIGINS)
                for row in rows:
                    for i, n in enumerate(self._rows[row["id"]].counts):
                        total[i] += n
                stats = runtime_stats(self._state) if done else None
                metrics = traced_metrics([t for _, t in traces], stats)
                changes: dict[str, Any] = {
                    "counts": dict(zip(ORIGINS, total, strict=True)),
                    "metrics": metrics.as_dict(), "metrics_html": metrics_html(metrics),
                    "done": done}
                if rows != self.rows:
                    changes["rows"] = rows
                for name, value in changes.items():
                    setattr(self, name, value)
                if deltas and self._send is not None:
                    self.seq += 1
                    self._send({"seq": self.seq, "base": self.seq - 1, "rows": deltas})
                shown = sum(len(row.tokens) for row in self._rows.values())
                if done or not self.snapshot or shown >= 4 * self._snapshot_size + _SNAPSHOT_MIN:
                    changes["snapshot"] = self.snapshot = snapshot_json(
                        self.seq, [(row["id"], self.tokens(row)) for row in rows])
                    self._snapshot_size = shown
                self._publish(changes)
                self._version = version
            spent = time.perf_counter() - started
            self.flushes += 1
            self.flush_seconds += spent
            self.flush_cpu_seconds += time.thread_time() - cpu
            self._next_at = time.monotonic() + spent / MAX_FLUSH_SHARE

    def resync(self) -> None:
        """Sends every row's tokens whole (a front end drawn late, or one that missed a
        delta)."""
        with self._lock:
            if self._send is not None:
                self._send({"seq": self.seq, "base": None, "rows": self._whole()})

    def close(self) -> None:
        """Stops updating and detaches from the program."""
        self._closed = True
        if self._throttle is not None:
            self._throttle.stop()
            if self._throttle.request in self._log.listeners:
                self._log.listeners.remove(self._throttle.request)
