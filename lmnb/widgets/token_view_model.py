"""`TokenViewModel`: what a `TokenView` shows and when it updates, without a widget library.

It reads a traced program run (`Program.run(..., token_view=True)`) into the view's synced state
(`rows`, `live`, `counts`, `metrics`, `metrics_html`, `done`), on a `Throttle` thread while the
program runs, and hands each update's changed fields to `publish` (the widget sets its traits
from them; a headless caller, e.g. the benchmark, serializes them as the comm would). Keeping
this apart from anywidget lets the update path run where no frontend library is installed.

Costs are bounded: each token is converted and serialized to JSON once (memoized by cell
identity; a row's JSON text is its tokens' texts joined), the tokens of finished gens are resent
only when they change, and the next live update waits until the last one's time is at most
`MAX_FLUSH_SHARE` of the time since. A long conversion releases the GIL every few dozen tokens:
the runtime's scheduler releases it for every tensor op and would otherwise wait up to the
interpreter's switch interval (5 ms) each time to get it back while a view converts.
"""

from __future__ import annotations

import html
import json
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from lmnb.lang.backends.base import ProgramAborted
from lmnb.lang.interpreter import StreamExecutor
from lmnb.lang.program import ProgramState
from lmnb.lang.token_trace import TokenTrace
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
SYNCED = ("rows", "live", "counts", "metrics", "metrics_html", "done")
_YIELD_EVERY = 32  # tokens converted between two releases of the GIL (~0.5-1 ms of work)


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


def _count(tokens: list[Token]) -> list[int]:
    """How many of `tokens` have each origin (by index)."""
    counts = [0] * len(ORIGINS)
    for token in tokens:
        counts[token[1]] += 1
    return counts


def _status(executor: StreamExecutor) -> str:
    if isinstance(executor.error, ProgramAborted):
        return "aborted"
    if executor.error is not None:
        return "error"
    return "running" if not executor.idle and executor.alive else "done"


class TokenViewModel:
    """The synced state of a view of `state`'s traced run (see the module doc).

    `rows`: one per executor with a trace, in creation order: {id, label, status, tokens, tail}
    with the tokens of its finished gens as JSON text; `live`: per row id (str) the tokens of
    its running gen, as JSON text (`tokens(row)`: both, as lists); `counts`: tokens shown per
    origin; `metrics` / `metrics_html`: the metrics bar; `done`: nothing runs any more.
    `publish(changes)` gets the fields an update changed, from the updating thread.
    """

    def __init__(self, state: ProgramState, *, publish: Callable[[dict[str, Any]], None],
                 hz: float = 10.0, start: bool = True) -> None:
        trace = state.token_trace
        if trace is None:
            raise ValueError("this program run recorded no tokens: run it with "
                             "`program.run(..., token_view=True)` or `%%lmprogram --tokens`")
        self._state = state
        self._publish = publish
        self._log = trace.log
        self._texts = trace.log.token_text
        self._lock = threading.Lock()
        self._closed = False
        self._version = -1
        self._next_at = 0.0  # monotonic time before which a live flush is skipped
        # per row: id(cell) -> (cell, token, token as JSON)
        self._memo: dict[int, dict[int, tuple[list[Any], Token, str]]] = {}
        self._stable_keys: dict[int, tuple[int, int, int]] = {}  # per row: its finished part
        self._stable_tokens: dict[int, list[Token]] = {}  # per row, as `rows` has them in JSON
        self._live_tokens: dict[int, list[Token]] = {}
        self._stable_counts: dict[int, list[int]] = {}  # per row: its finished tokens by origin
        self.rows: list[dict[str, Any]] = []
        self.live: dict[str, str] = {}
        self.counts: dict[str, int] = {}
        self.metrics: dict[str, Any] = {}
        self.metrics_html = ""
        self.done = False
        self.flushes = 0
        self.flush_seconds = 0.0  # time spent building and publishing updates (benchmarks)
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

    def _token(self, cell: list[Any]) -> Token:
        text = self._texts
        token_id, origin, logprob, top = cell
        alternatives = ([[text(alt_id), round(alt_lp, 3)] for alt_lp, alt_id, *_ in top]
                        if top else None)
        return [text(token_id), origin, None if logprob is None else round(logprob, 3),
                alternatives]

    def _convert(self, memo_key: int, cells: list[list[Any]]) -> tuple[list[Token], str]:
        """The cells as tokens and as a JSON list; a cell met in the last update of `memo_key`
        or of the row's other part (the same object) is not converted or serialized again."""
        memo, other = self._memo.get(memo_key, {}), self._memo.get(-1 - memo_key, {})
        kept: dict[int, tuple[list[Any], Token, str]] = {}
        tokens, texts = [], []
        converted = 0
        for cell in cells:
            hit = memo.get(id(cell)) or other.get(id(cell))
            if hit is None or hit[0] is not cell:
                token = self._token(cell)
                hit = (cell, token, json.dumps(token))
                converted += 1
                if converted % _YIELD_EVERY == 0:
                    time.sleep(0)  # lets the runtime's threads take the GIL back (see above)
            kept[id(cell)] = hit
            tokens.append(hit[1])
            texts.append(hit[2])
        self._memo[memo_key] = kept
        return tokens, f"[{', '.join(texts)}]"

    def _read(self) -> tuple[list[dict[str, Any]], dict[str, str], bool]:
        """(rows, live, rows changed): each row's tokens of finished gens (resent only when they
        change) and, in `live`, those of its running gen."""
        rows, live = [], {}
        changed = False
        previous = {row["id"]: row for row in self.rows}
        for index, (executor, trace) in enumerate(self._traces()):
            cells, stable = trace.cells_split()
            start = 0
            inherited = trace.inherited_ids
            while start < min(len(inherited), len(cells)) and cells[start][0] == inherited[start]:
                start += 1
            stable = max(stable, start)
            key = (start, stable, id(cells[stable - 1]) if stable else 0)
            text = executor.text_
            covered = trace.covered_chars()
            tail = text[covered:] if trace.records and covered < len(text) else ""
            if not trace.records:
                tail = text[executor.fork_point:]
            row = {"id": executor.id, "label": "root" if index == 0 else f"fork {index}",
                   "status": _status(executor), "tail": tail}
            old = previous.get(executor.id)
            if old is not None and self._stable_keys.get(executor.id) == key:
                row["tokens"] = old["tokens"]
            else:
                tokens, row["tokens"] = self._convert(executor.id, cells[start:stable])
                self._stable_tokens[executor.id] = tokens
                self._stable_counts[executor.id] = _count(tokens)
                self._stable_keys[executor.id] = key
            changed = changed or old is None or any(old[k] != row[k] for k in row)
            self._live_tokens[executor.id], live[str(executor.id)] = self._convert(
                -1 - executor.id, cells[stable:])
            rows.append(row)
        return rows, live, changed or len(rows) != len(self.rows)

    def tokens(self, row: dict[str, Any]) -> list[Token]:
        """All the tokens a row shows: those of finished gens, then the running gen's."""
        return self._stable_tokens.get(row["id"], []) + self._live_tokens.get(row["id"], [])

    def _counts(self, rows: list[dict[str, Any]]) -> dict[str, int]:
        """Tokens shown per origin (the finished parts' counts are kept)."""
        total = [0] * len(ORIGINS)
        for row in rows:
            for counts in (self._stable_counts.get(row["id"]),
                           _count(self._live_tokens.get(row["id"], []))):
                for i, n in enumerate(counts or ()):
                    total[i] += n
        return dict(zip(ORIGINS, total, strict=True))

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
            started = time.perf_counter()
            version = self._log.version
            traces = self._traces()
            done = all(_status(executor) != "running" for executor, _ in traces)
            if version != self._version or done != self.done:
                rows, live, rows_changed = self._read()
                stats = runtime_stats(self._state) if done else None
                metrics = traced_metrics([t for _, t in traces], stats)
                changes: dict[str, Any] = {
                    "live": live, "counts": self._counts(rows), "metrics": metrics.as_dict(),
                    "metrics_html": metrics_html(metrics), "done": done}
                if rows_changed:
                    changes["rows"] = rows
                for name, value in changes.items():
                    setattr(self, name, value)
                self._publish(changes)
                self._version = version
            spent = time.perf_counter() - started
            self.flushes += 1
            self.flush_seconds += spent
            self._next_at = time.monotonic() + spent / MAX_FLUSH_SHARE

    def close(self) -> None:
        """Stops updating and detaches from the program."""
        self._closed = True
        if self._throttle is not None:
            self._throttle.stop()
            if self._throttle.request in self._log.listeners:
                self._log.listeners.remove(self._throttle.request)
