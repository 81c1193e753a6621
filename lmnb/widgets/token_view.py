"""`TokenView`: a program's text token by token, coloured by where each token came from.

Prompt tokens computed or served from the radix cache, tokens generated (shaded by their
probability: the less sure the model was, the stronger the tint), forced by jump-forward or
accepted from speculation; hovering a token shows its logprob and top-k alternatives. One row per
executor (the root state, then each fork, showing what it adds after the fork). Live while the
program runs; in a saved notebook, its `text/html` (inline styles and `title` tooltips) shows
the final state where no widget can render (nbconvert, GitHub). What it shows and when it
updates is `TokenViewModel`'s (token_view_model.py, no widget library needed); this module is
the anywidget around it.
"""

from __future__ import annotations

import html
from typing import Any

import anywidget
import traitlets

from lmnb.lang.program import ProgramState
from lmnb.runtime.output.token_origins import ORIGINS
from lmnb.widgets.esm_helpers import ESM_HELPERS
from lmnb.widgets.metrics import Metrics, metrics_text
from lmnb.widgets.saved_text import SavedText
from lmnb.widgets.token_view_model import (
    COLORS,
    LABELS,
    MAX_FLUSH_SHARE,
    Token,
    TokenViewModel,
    generated_color,
    rows_html,
    token_title,
)

__all__ = ["COLORS", "LABELS", "MAX_FLUSH_SHARE", "TokenView", "generated_color", "rows_html",
           "token_title"]

_ESM = ESM_HELPERS + r"""
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

// Tokens per row id: what the kernel sent (deltas after one whole state; see
// token_view_model.py). `dirty`: the first token not drawn as it is now.
function store() {
  return { seq: -1, rows: new Map(), waiting: true, asked: false };
}

function apply(tokens, msg) {
  if (msg.base === null || msg.base === undefined) {  // the whole state
    tokens.rows.clear();
    for (const [id, , toks] of msg.rows) tokens.rows.set(String(id), { toks, dirty: 0 });
    tokens.seq = msg.seq;
    tokens.waiting = tokens.asked = false;
    return true;
  }
  if (tokens.waiting || msg.base !== tokens.seq) return false;  // missed one: catch up
  for (const [id, cut, toks] of msg.rows) {
    const key = String(id);
    let row = tokens.rows.get(key);
    if (!row) { row = { toks: [], dirty: 0 }; tokens.rows.set(key, row); }
    row.toks.length = cut;
    for (const tok of toks) row.toks.push(tok);
    row.dirty = Math.min(row.dirty, cut);
  }
  tokens.seq = msg.seq;
  return true;
}

// A delta or whole state from the kernel: false when it cannot be applied (wait for more).
function receive(tokens, msg) {
  if (apply(tokens, msg)) return true;
  tokens.waiting = true;
  return false;
}

// The `snapshot` trait's state, taken while not in step with the deltas.
function catchUp(tokens, text) {
  if (!text || !tokens.waiting) return false;
  const snap = JSON.parse(text);
  const whole = Object.entries(snap.rows).map(([id, toks]) => [id, 0, toks]);
  return apply(tokens, { seq: snap.seq, base: null, rows: whole });
}

function fillRow(view, row, tokens, origins) {
  view.p.dataset.id = String(row.id);
  view.p.dataset.status = row.status;
  view.label.textContent = row.label;
  view.status.textContent = row.status;
  const shown = tokens.rows.get(String(row.id)) || { toks: [], dirty: 0 };
  const from = Math.min(shown.dirty, view.box.children.length);
  while (view.box.children.length > from) view.box.lastChild.remove();
  const spans = document.createDocumentFragment();
  for (let j = from; j < shown.toks.length; j++) spans.append(tokenSpan(shown.toks[j], origins));
  view.box.append(spans);
  shown.dirty = Infinity;
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
  return { p, label, status, box, tail };
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
  const tokens = store();

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
    for (const row of model.get("rows") || []) {
      seen.add(row.id);
      let view = views.get(row.id);
      if (!view) {
        view = rowView();
        views.set(row.id, view);
        const shown = tokens.rows.get(String(row.id));
        if (shown) shown.dirty = 0;
      }
      rows.append(view.p);
      fillRow(view, row, tokens, origins);
    }
    for (const [id, view] of views) {
      if (!seen.has(id)) { view.p.remove(); views.delete(id); }
    }
  };
  const names = ["change:rows", "change:metrics_html", "change:done", "change:title",
                 "change:counts"];
  let pending = false;  // one redraw per frame, however many messages came
  const schedule = () => {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => { pending = false; draw(); });
  };
  const onMessage = (msg) => {
    if (!msg || !Array.isArray(msg.rows)) return;
    if (receive(tokens, msg)) {
      schedule();
    } else if (!tokens.asked) {  // until a snapshot or the kernel's answer (once it is idle)
      tokens.asked = true;
      model.send({ type: "sync" });
    }
  };
  // every row's tokens now and then (and when done: saved widget state has no kernel to ask)
  const onSnapshot = () => { if (catchUp(tokens, model.get("snapshot"))) schedule(); };
  for (const name of names) model.on(name, schedule);
  model.on("change:snapshot", onSnapshot);
  model.on("msg:custom", onMessage);
  onSnapshot();
  draw();
  return () => {
    for (const name of names) model.off(name, schedule);
    model.off("change:snapshot", onSnapshot);
    model.off("msg:custom", onMessage);
  };
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


class TokenView(SavedText, anywidget.AnyWidget):
    """Every token of a traced program run (`Program.run(..., token_view=True)`,
    `%%lmprogram --tokens`, `state.token_view()`), coloured by origin, with a metrics bar.

    Its traits are `TokenViewModel`'s small synced state: `rows` (one header per executor with
    a trace: {id, label, status, tail}), `counts`, `metrics`, `metrics_html`, `done` and
    `snapshot` (every row's tokens as JSON text with their `seq`: on the first update, when the
    tokens grew fourfold, when done; what a front end drawn late catches up from, and what
    saved widget state keeps). The tokens travel as custom comm messages: deltas of what
    changed since the last update, and every row whole when a front end that missed one asks
    (`{"type": "sync"}`, answered once the kernel is idle). A token is [text, origin index into
    `origins`, logprob or None, top-k [[text, logprob]]] (`tokens(row)`: a row's, as lists);
    `tail` is the executor's text after its last traced gen. Updates at most `hz` times a
    second, and less often when an update takes long (it is kept under ~2% of the wall clock).
    """

    _esm = _ESM
    _css = _CSS
    title = traitlets.Unicode("").tag(sync=True)
    rows = traitlets.List(traitlets.Dict()).tag(sync=True)
    counts = traitlets.Dict().tag(sync=True)
    metrics = traitlets.Dict().tag(sync=True)
    metrics_html = traitlets.Unicode("").tag(sync=True)
    origins = traitlets.List(traitlets.Unicode(), default_value=list(ORIGINS)).tag(sync=True)
    colors = traitlets.Dict(default_value=COLORS).tag(sync=True)
    labels = traitlets.Dict(default_value=LABELS).tag(sync=True)
    done = traitlets.Bool(False).tag(sync=True)
    snapshot = traitlets.Unicode("").tag(sync=True)
    _model: TokenViewModel | None = None  # None until set up (a refused view closes without one)

    def __init__(self, state: ProgramState, *, title: str = "", hz: float = 10.0) -> None:
        model = TokenViewModel(state, publish=self._publish, send=self.send,
                               start=False)  # refuses untraced
        super().__init__(title=title)
        self._model = model
        self.on_msg(self._on_front_end_message)
        model.start(hz)

    def _on_front_end_message(self, _widget: Any, content: Any, _buffers: Any) -> None:
        if isinstance(content, dict) and content.get("type") == "sync" and self._model:
            self._model.resync()

    def _publish(self, changes: dict[str, Any]) -> None:
        with self.hold_sync():
            for name, value in changes.items():
                setattr(self, name, value)

    @property
    def flushes(self) -> int:
        return self._model.flushes if self._model is not None else 0

    @property
    def flush_seconds(self) -> float:
        """Time spent building and setting the rows (benchmarks)."""
        return self._model.flush_seconds if self._model is not None else 0.0

    def tokens(self, row: dict[str, Any]) -> list[Token]:
        """The tokens a row shows (not to be changed)."""
        return self._model.tokens(row) if self._model is not None else []

    def refresh(self) -> None:
        """Reads the traces and updates the view now."""
        if self._model is not None:
            self._model.refresh()
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
        if self._model is not None:
            self._model.close()
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
