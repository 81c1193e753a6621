"""`TokenView`: a program's text token by token, coloured by where each token came from.

Prompt tokens computed or served from the radix cache, tokens generated (shaded by their
probability: the less sure the model was, the stronger the tint), forced by jump-forward or
accepted from speculation; hovering a token shows its logprob and top-k alternatives. One row per
executor (the root state, then each fork, showing what it adds after the fork). Live while the
program runs; in a saved notebook, its `text/html` (inline styles and `title` tooltips) shows
the final state where no widget can render (nbconvert, GitHub).
"""

from __future__ import annotations

import html
import json
import math
import threading
import time
from typing import Any

import anywidget
import traitlets

from lmnb.lang.backends.base import ProgramAborted
from lmnb.lang.interpreter import StreamExecutor
from lmnb.lang.program import ProgramState
from lmnb.lang.token_trace import TokenTrace
from lmnb.runtime.output.token_origins import ORIGINS
from lmnb.widgets.metrics import (
    Metrics,
    metrics_html,
    metrics_text,
    runtime_stats,
    traced_metrics,
)
from lmnb.widgets.saved_text import SavedText
from lmnb.widgets.throttle import Throttle

# A token on the wire: [text, origin index (ORIGINS), logprob or None, [[text, logprob], ...]]
Token = list[Any]

# Tints per origin (calm; generated is drawn from its probability instead).
COLORS = {"computed": "#e5e7eb", "cached": "#bfdbfe", "generated": "#bbf7d0",
          "jump_forward": "#fde68a", "speculated": "#ddd6fe"}
LABELS = {"computed": "prompt, computed", "cached": "prompt, from cache",
          "generated": "generated", "jump_forward": "jump-forward", "speculated": "speculated"}
MAX_FLUSH_SHARE = 0.02  # a live view spends at most ~2% of the wall clock updating itself

_ESM = r"""
function node(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

// Generated tokens: the lower the probability, the stronger the green.
const genColor = (lp) => {
  const p = Math.exp(lp);
  return `hsl(142, 70%, ${(56 + 30 * p).toFixed(1)}%)`;
};

function tip(tok, origins) {
  const [text, origin, lp, alts] = tok;
  let t = `${JSON.stringify(text)}  ${origins[origin]}`;
  if (lp !== null && lp !== undefined) {
    t += `\nlogprob ${lp.toFixed(3)} (p=${Math.exp(lp).toFixed(3)})`;
  }
  if (alts && alts.length) {
    t += "\ntop alternatives:";
    for (const [alt, alp] of alts) t += `\n  ${JSON.stringify(alt)}  ${alp.toFixed(3)}`;
  }
  return t;
}

function tokenSpan(tok, origins) {
  const origin = origins[tok[1]];
  const span = node("span", "lmnb-tv-tok lmnb-tv-" + origin, tok[0]);
  if (origin === "generated" && tok[2] !== null && tok[2] !== undefined) {
    span.style.background = genColor(tok[2]);
  }
  span.title = tip(tok, origins);
  return span;
}

const same = (a, b) => a && b && a[0] === b[0] && a[1] === b[1] && a[2] === b[2];

function fillRow(view, row, live, origins) {
  view.p.dataset.id = String(row.id);
  view.p.dataset.status = row.status;
  view.label.textContent = row.label;
  view.status.textContent = row.status;
  // tokens travel as JSON text (one string per row: the widget comm need not walk them)
  if (row.tokens !== view.stableText) {
    view.stableText = row.tokens;
    view.stable = JSON.parse(row.tokens || "[]");
  }
  const tokens = view.stable.concat(JSON.parse(live[String(row.id)] || "[]"));
  const old = view.tokens;
  let i = 0;  // redraw from the first token that changed (live updates append)
  while (i < tokens.length && i < old.length && same(tokens[i], old[i])) i++;
  while (view.box.children.length > i) view.box.lastChild.remove();
  for (let j = i; j < tokens.length; j++) view.box.append(tokenSpan(tokens[j], origins));
  view.tokens = tokens;
  view.tail.textContent = row.tail || "";
  view.tail.hidden = !row.tail;
}

function rowView() {
  const p = node("div", "lmnb-tv-row");
  const head = node("div", "lmnb-tv-head");
  const label = node("span", "lmnb-tv-label");
  const status = node("span", "lmnb-tv-status");
  head.append(label, status);
  const text = node("div", "lmnb-tv-text");
  const box = node("span", "lmnb-tv-tokens");
  const tail = node("span", "lmnb-tv-tail");
  text.append(box, tail);
  p.append(head, text);
  return { p, label, status, box, tail, tokens: [], stable: [], stableText: null };
}

function render({ model, el }) {
  const root = node("div", "lmnb-tokenview");
  const title = node("div", "lmnb-tv-title");
  const metrics = node("div", "lmnb-tv-metrics");
  const legend = node("div", "lmnb-tv-legend");
  const rows = node("div", "lmnb-tv-rows");
  root.append(title, metrics, legend, rows);
  el.append(root);
  const views = new Map();

  const draw = () => {
    const origins = model.get("origins");
    const colors = model.get("colors");
    const labels = model.get("labels");
    title.textContent = model.get("title") || "";
    title.hidden = !title.textContent;
    root.dataset.done = String(model.get("done"));
    metrics.innerHTML = model.get("metrics_html") || "";
    const counts = model.get("counts") || {};
    legend.replaceChildren();
    for (const origin of origins) {
      const item = node("span", "lmnb-tv-key");
      item.dataset.origin = origin;
      const sw = node("span", "lmnb-tv-swatch");
      sw.style.background = colors[origin];
      item.append(sw, document.createTextNode(` ${labels[origin]} ${counts[origin] ?? 0}`));
      legend.append(item);
    }
    const seen = new Set();
    const live = model.get("live") || {};
    for (const row of model.get("rows") || []) {
      seen.add(row.id);
      let view = views.get(row.id);
      if (!view) { view = rowView(); views.set(row.id, view); }
      rows.append(view.p);
      fillRow(view, row, live, origins);
    }
    for (const [id, view] of views) {
      if (!seen.has(id)) { view.p.remove(); views.delete(id); }
    }
  };
  const names = ["change:rows", "change:live", "change:metrics_html", "change:done",
                 "change:title", "change:counts"];
  let pending = false;  // one redraw per frame, however many traits an update changed
  const schedule = () => {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => { pending = false; draw(); });
  };
  for (const name of names) model.on(name, schedule);
  draw();
  return () => { for (const name of names) model.off(name, schedule); };
}

export default { render };
"""

_CSS = r"""
.lmnb-tokenview { font-family: var(--jp-ui-font-family, sans-serif); font-size: 13px;
  color: var(--jp-ui-font-color1, #222); }
.lmnb-tokenview .lmnb-tv-title { font-weight: 600; margin-bottom: 2px; }
.lmnb-tokenview .lmnb-tv-legend { display: flex; flex-wrap: wrap; gap: 4px 12px;
  font-size: 12px; margin: 2px 0 6px; }
.lmnb-tokenview .lmnb-tv-swatch { display: inline-block; width: 10px; height: 10px;
  border-radius: 2px; vertical-align: middle; border: 1px solid #0002; }
.lmnb-tokenview .lmnb-tv-row { border: 1px solid var(--jp-border-color1, #ccc);
  border-radius: 4px; padding: 4px 6px; margin-bottom: 6px;
  background: var(--jp-layout-color1, #fff); }
.lmnb-tokenview .lmnb-tv-head { display: flex; justify-content: space-between;
  font-weight: 600; margin-bottom: 2px; }
.lmnb-tokenview .lmnb-tv-status { font-weight: 400; font-size: 11px; }
.lmnb-tokenview .lmnb-tv-text { white-space: pre-wrap; word-break: break-word;
  max-height: 360px; overflow-y: auto; line-height: 1.6;
  font-family: var(--jp-code-font-family, monospace); font-size: 12px; }
.lmnb-tokenview .lmnb-tv-tok { color: #111; border-radius: 2px; margin-right: 1px;
  box-shadow: inset -1px 0 #0001; }
.lmnb-tokenview .lmnb-tv-computed { background: #e5e7eb; }
.lmnb-tokenview .lmnb-tv-cached { background: #bfdbfe; }
.lmnb-tokenview .lmnb-tv-generated { background: #bbf7d0; }
.lmnb-tokenview .lmnb-tv-jump_forward { background: #fde68a; }
.lmnb-tokenview .lmnb-tv-speculated { background: #ddd6fe; }
.lmnb-tokenview .lmnb-tv-tok:hover { outline: 1px solid #333; }
.lmnb-tokenview .lmnb-tv-tail { opacity: .6; }
"""


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


class TokenView(SavedText, anywidget.AnyWidget):
    """Every token of a traced program run (`Program.run(..., token_view=True)`,
    `%%lmprogram --tokens`, `state.token_view()`), coloured by origin, with a metrics bar.

    `rows`: one per executor with a trace, in creation order: {id, label, status, tokens, tail}
    with the tokens of its finished gens as JSON text (resent only when those change; text, so
    that the comm does not walk thousands of lists), `live`: per row id the tokens of its
    running gen, as JSON text (`tokens(row)`: both, as lists). A token is [text, origin index into
    `origins`, logprob or None, top-k [[text, logprob]]]; `tail` is the executor's text after its
    last traced gen. `counts`: tokens shown per origin.
    Updates at most `hz` times a second, and less often when the rows grow large (the update
    itself is kept under ~2% of the wall clock).
    """

    _esm = _ESM
    _css = _CSS
    title = traitlets.Unicode("").tag(sync=True)
    rows = traitlets.List(traitlets.Dict()).tag(sync=True)
    live = traitlets.Dict(traitlets.Unicode()).tag(sync=True)
    counts = traitlets.Dict().tag(sync=True)
    metrics = traitlets.Dict().tag(sync=True)
    metrics_html = traitlets.Unicode("").tag(sync=True)
    origins = traitlets.List(traitlets.Unicode(), default_value=list(ORIGINS)).tag(sync=True)
    colors = traitlets.Dict(default_value=COLORS).tag(sync=True)
    labels = traitlets.Dict(default_value=LABELS).tag(sync=True)
    done = traitlets.Bool(False).tag(sync=True)
    _throttle: Throttle | None = None  # None until set up (a refused view closes without one)

    def __init__(self, state: ProgramState, *, title: str = "", hz: float = 10.0) -> None:
        trace = state.token_trace
        if trace is None:
            raise ValueError("this program run recorded no tokens: run it with "
                             "`program.run(..., token_view=True)` or `%%lmprogram --tokens`")
        super().__init__(title=title)
        self._state = state
        self._log = trace.log
        self._texts = trace.log.token_text
        self._lock = threading.Lock()
        self._closed = False
        self._version = -1
        self._next_at = 0.0  # monotonic time before which a live flush is skipped
        self._memo: dict[int, dict[int, tuple[list[Any], Token]]] = {}  # per row: id(cell) ->
        self._stable_keys: dict[int, tuple[int, int, int]] = {}  # per row: its finished part
        self._stable_tokens: dict[int, list[Token]] = {}  # per row, as `rows` has them in JSON
        self._live_tokens: dict[int, list[Token]] = {}
        self._stable_counts: dict[int, list[int]] = {}  # per row: its finished tokens by origin
        self.flushes = 0
        self.flush_seconds = 0.0  # time spent building and setting the rows (benchmarks)
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

    def _convert(self, row_id: int, cells: list[list[Any]]) -> list[Token]:
        """The cells as tokens; a cell met in the last update (the same object) is not
        converted again."""
        memo, kept = self._memo.get(row_id, {}), {}
        tokens = []
        for cell in cells:
            hit = memo.get(id(cell))
            token = hit[1] if hit is not None and hit[0] is cell else self._token(cell)
            kept[id(cell)] = (cell, token)
            tokens.append(token)
        self._memo[row_id] = kept
        return tokens

    def _read(self) -> tuple[list[dict[str, Any]], dict[str, list[Token]], bool]:
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
                self._stable_tokens[executor.id] = tokens = self._convert(
                    executor.id, cells[start:stable])
                self._stable_counts[executor.id] = _count(tokens)
                row["tokens"] = json.dumps(tokens)
                self._stable_keys[executor.id] = key
            changed = changed or old is None or any(old[k] != row[k] for k in row)
            self._live_tokens[executor.id] = tokens = self._convert(-1 - executor.id,
                                                                    cells[stable:])
            live[str(executor.id)] = json.dumps(tokens)
            rows.append(row)
        return rows, live, changed or len(rows) != len(self.rows)

    def tokens(self, row: dict[str, Any]) -> list[Token]:
        """All the tokens a row shows: those of finished gens, then the running gen's."""
        return self._stable_tokens.get(row["id"], []) + self._live_tokens.get(row["id"], [])

    def _counts(self) -> dict[str, int]:
        """Tokens shown per origin (the finished parts' counts are kept)."""
        total = [0] * len(ORIGINS)
        for row in self.rows:
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
        """Reads the traces and updates the view now."""
        with self._lock:
            started = time.perf_counter()
            version = self._log.version
            traces = self._traces()
            done = all(_status(executor) != "running" for executor, _ in traces)
            if version != self._version or done != self.done:
                rows, live, rows_changed = self._read()
                stats = runtime_stats(self._state) if done else None
                metrics = traced_metrics([t for _, t in traces], stats)
                with self.hold_sync():
                    if rows_changed:
                        self.rows = rows
                    self.live = live
                    self.counts = self._counts()
                    self.metrics = metrics.as_dict()
                    self.metrics_html = metrics_html(metrics)
                    self.done = done
                self._version = version
            spent = time.perf_counter() - started
            self.flushes += 1
            self.flush_seconds += spent
            self._next_at = time.monotonic() + spent / MAX_FLUSH_SHARE
        self.update_saved_text()

    # ---- display -----------------------------------------------------------------------------
    def static_html(self) -> str:
        """The view as HTML without the widget (what a saved notebook keeps)."""
        legend = " ".join(
            f'<span style="background:{COLORS[o]};padding:0 4px;border-radius:2px">'
            f"{html.escape(LABELS[o])} {self.counts.get(o, 0)}</span>" for o in ORIGINS)
        title = f"<b>{html.escape(self.title)}</b>" if self.title else ""
        return (f'<div class="lmnb-tokenview-static">{title}{self.metrics_html}'
                f'<div style="font-size:12px;margin:2px 0 6px">{legend}</div>'
                f"{rows_html([(row, self.tokens(row)) for row in self.rows])}</div>")

    def _repr_mimebundle_(self, **kwargs: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        bundle = super()._repr_mimebundle_(**kwargs)
        data, metadata = bundle if isinstance(bundle, tuple) else (bundle, {})
        return {**(data or {}), "text/html": self.static_html()}, metadata or {}

    def close(self) -> None:
        """Stops updating and detaches from the program."""
        self._closed = True
        if self._throttle is not None:
            self._throttle.stop()
            if self._throttle.request in self._log.listeners:
                self._log.listeners.remove(self._throttle.request)
        super().close()

    def __repr__(self) -> str:
        counts = ", ".join(f"{LABELS[o]} {n}" for o, n in self.counts.items() if n)
        lines = [f"TokenView: {len(self.rows)} rows, {'done' if self.done else 'running'}"
                 f"{'; ' + counts if counts else ''}"]
        if self.metrics:
            lines.append("  " + metrics_text(Metrics(**self.metrics)))
        for row in self.rows:
            text = "".join(token[0] for token in self.tokens(row)) + row["tail"]
            if len(text) > 300:
                text = "…" + text[-299:]
            lines.append(f"  {row['label']} ({row['status']}): {text!r}")
        return "\n".join(lines)
