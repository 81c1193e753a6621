"""`ForkView`: the branches of a running program side by side, streaming live."""

from __future__ import annotations

import threading
from typing import Any

import anywidget
import traitlets

from lmnb.lang.backends.base import ProgramAborted
from lmnb.lang.interpreter import StreamExecutor
from lmnb.lang.program import ProgramState
from lmnb.widgets.esm_helpers import ESM_HELPERS
from lmnb.widgets.saved_text import SavedText
from lmnb.widgets.throttle import Throttle

Segment = dict[str, Any]  # {"text": str, "var": str | None}

_ESM = ESM_HELPERS + r"""
// A variable's hue, among greens, blues and violets (140-300): never a red that reads as an error.
const hue = (name) => {
  let h = 0;
  for (const c of name) h = (h * 31 + c.charCodeAt(0)) % 160;
  return 140 + h;
};

function fillText(box, segments) {
  const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 4;
  box.replaceChildren();
  for (const seg of segments || []) {
    if (seg.var === null || seg.var === undefined) {
      box.append(document.createTextNode(seg.text));
    } else {
      const mark = node("mark", "lmnb-var", seg.text);
      mark.dataset.var = seg.var;
      mark.title = seg.var;
      mark.style.setProperty("--lmnb-var-hue", String(hue(seg.var)));
      box.append(mark);
    }
  }
  if (atBottom) box.scrollTop = box.scrollHeight;
}

function panel(cls) {
  const p = node("div", cls);
  const head = node("div", "lmnb-head");
  const label = node("span", "lmnb-label");
  const status = node("span", "lmnb-status");
  head.append(label, status);
  const error = node("div", "lmnb-error");
  const text = node("div", "lmnb-text");
  p.append(head, error, text);
  return { p, label, status, error, text };
}

function fill(view, data) {
  view.p.dataset.id = String(data.id);
  view.p.dataset.status = data.status;
  view.label.textContent = data.label;
  view.status.textContent = data.status;
  view.status.dataset.status = data.status;
  view.error.textContent = data.error || "";
  view.error.hidden = !data.error;
  fillText(view.text, data.segments);
}

function render({ model, el }) {
  const box = node("div", "lmnb-forkview");
  const title = node("div", "lmnb-title");
  const root = panel("lmnb-root");
  const columns = node("div", "lmnb-columns");
  box.append(title, root.p, columns);
  el.append(box);
  const views = new Map();

  const draw = () => {
    title.textContent = model.get("title") || "";
    title.hidden = !title.textContent;
    box.dataset.done = String(model.get("done"));
    const rootData = model.get("root");
    root.p.hidden = !rootData || rootData.id === undefined;
    if (!root.p.hidden) fill(root, rootData);
    const branches = model.get("branches") || [];
    const seen = new Set();
    for (const data of branches) {
      seen.add(data.id);
      let view = views.get(data.id);
      if (!view) {
        view = panel("lmnb-branch");
        views.set(data.id, view);
      }
      columns.append(view.p);  // keeps the model's order
      fill(view, data);
    }
    for (const [id, view] of views) {
      if (!seen.has(id)) {
        view.p.remove();
        views.delete(id);
      }
    }
  };
  const names = ["change:root", "change:branches", "change:title", "change:done"];
  return redrawOn(model, names, draw);
}

export default { render };
"""

_CSS = r"""
.lmnb-forkview { font-family: var(--jp-ui-font-family, sans-serif); font-size: 13px;
  color: var(--jp-ui-font-color1, #222); }
.lmnb-forkview .lmnb-title { font-weight: 600; margin-bottom: 4px; }
.lmnb-forkview .lmnb-columns { display: flex; gap: 8px; overflow-x: auto; margin-top: 8px; }
.lmnb-forkview .lmnb-branch { flex: 1 1 0; min-width: 180px; }
.lmnb-forkview .lmnb-root, .lmnb-forkview .lmnb-branch {
  border: 1px solid var(--jp-border-color1, #ccc); border-radius: 4px; padding: 4px 6px;
  background: var(--jp-layout-color1, #fff); }
.lmnb-forkview .lmnb-head { display: flex; justify-content: space-between; font-weight: 600;
  margin-bottom: 2px; }
.lmnb-forkview .lmnb-status { font-weight: 400; font-size: 11px; padding: 0 6px;
  border-radius: 8px; background: #ddd; color: #222; }
.lmnb-forkview .lmnb-status[data-status="running"] { background: #fde68a; }
.lmnb-forkview .lmnb-status[data-status="done"] { background: #bbf7d0; }
.lmnb-forkview .lmnb-status[data-status="error"],
.lmnb-forkview .lmnb-status[data-status="aborted"] { background: #fecaca; }
.lmnb-forkview .lmnb-error { color: #b91c1c; font-size: 12px; }
.lmnb-forkview .lmnb-text { white-space: pre-wrap; word-break: break-word; max-height: 320px;
  overflow-y: auto; font-family: var(--jp-code-font-family, monospace); font-size: 12px; }
.lmnb-forkview .lmnb-root .lmnb-text { max-height: 160px; }
.lmnb-forkview mark.lmnb-var { color: #111; border-radius: 2px;
  background: hsl(var(--lmnb-var-hue, 200), 80%, 82%);
  box-shadow: inset 0 -2px hsl(var(--lmnb-var-hue, 200), 60%, 45%); }
"""


def segments(text: str, spans: list[tuple[str, int, int]], start: int = 0) -> list[Segment]:
    """`text[start:]` cut into plain runs and runs generated for a variable."""
    out: list[Segment] = []
    at = start
    for var, begin, end in sorted(spans, key=lambda span: span[1]):
        begin, end = max(begin, at), min(end, len(text))
        if end <= begin:
            continue
        if begin > at:
            out.append({"text": text[at:begin], "var": None})
        out.append({"text": text[begin:end], "var": var})
        at = end
    if at < len(text):
        out.append({"text": text[at:], "var": None})
    return out


def _status(executor: StreamExecutor) -> tuple[str, str | None]:
    error = executor.error
    if isinstance(error, ProgramAborted):
        return "aborted", str(error)
    if error is not None:
        return "error", f"{type(error).__name__}: {error}"
    # A stopped worker runs nothing, even if its queue still counts an item (put after close).
    running = not executor.idle and executor.alive
    return ("running" if running else "done"), None


def _panel(executor: StreamExecutor, *, label: str, start: int) -> dict[str, Any]:
    text = executor.text_
    spans = list(executor.spans)
    streaming = executor.streaming  # (variable, start) of a running gen
    if streaming is not None and streaming[0] is not None:
        spans.append((streaming[0], streaming[1], len(text)))
    status, error = _status(executor)
    return {"id": executor.id, "label": label, "status": status, "error": error,
            "segments": segments(text, spans, min(start, len(text)))}


class ForkView(SavedText, anywidget.AnyWidget):
    """The text of a program's root state on top and of each fork branch in columns, with
    generated variables highlighted, streaming while the program runs.

    `root`: {id, label, status, error, segments}; `branches`: the same plus `parent` (executor id)
    and `fork_point`, in creation order. A segment is {text, var}: `var` names the variable that
    generated it, or is None. Status is running, done, error or aborted.
    """

    _esm = _ESM
    _css = _CSS
    title = traitlets.Unicode("").tag(sync=True)
    root = traitlets.Dict().tag(sync=True)
    branches = traitlets.List(traitlets.Dict()).tag(sync=True)
    done = traitlets.Bool(False).tag(sync=True)

    def __init__(self, state: ProgramState, *, title: str = "", hz: float = 20.0) -> None:
        super().__init__(title=title)
        self._state = state
        self._lock = threading.Lock()
        self._executors: dict[int, StreamExecutor] = {}
        self._parents: dict[int, int] = {}
        self._closed = False
        self._throttle = Throttle(self._flush, hz=hz)
        state.observe(self._on_event)
        self.refresh()
        self._throttle.request()  # keeps updating while anything runs

    # ---- updates ---------------------------------------------------------------------------
    def _on_event(self, kind: str, executor: StreamExecutor, data: dict[str, Any]) -> None:
        if kind == "fork":
            with self._lock:
                for branch in data["branches"]:
                    self._executors.setdefault(branch.id, branch)
                    self._parents[branch.id] = executor.id
        self._throttle.request()

    def _flush(self) -> bool:
        if self._closed:
            return False
        self.refresh()
        return not self.done

    def refresh(self) -> None:
        """Reads the program's executors and updates the view now."""
        with self._lock:
            root, branches = self._read()
            done = root["status"] != "running" and all(b["status"] != "running"
                                                       for b in branches)
            with self.hold_sync():
                self.root = root
                self.branches = branches
                self.done = done
        self.update_saved_text()

    def _read(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        top = self._state.executor
        for executor in self._state.run.executors:
            self._executors.setdefault(executor.id, executor)
        ordered = [e for _, e in sorted(self._executors.items()) if e is not top]
        for i, branch in enumerate(ordered):
            if branch.id not in self._parents:
                self._parents[branch.id] = self._guess_parent(branch, [top, *ordered[:i]])
        labels: dict[int, str] = {top.id: "root"}
        children: dict[int, int] = {}
        branches = []
        for branch in ordered:
            parent = self._parents[branch.id]
            children[parent] = children.get(parent, 0) + 1
            prefix = "branch " if parent not in labels or parent == top.id else \
                labels[parent] + "."
            labels[branch.id] = f"{prefix}{children[parent]}"
            panel = _panel(branch, label=labels[branch.id], start=branch.fork_point)
            branches.append({**panel, "parent": parent, "fork_point": branch.fork_point})
        return _panel(top, label="root", start=0), branches

    @staticmethod
    def _guess_parent(branch: StreamExecutor, earlier: list[StreamExecutor]) -> int:
        """For branches forked before this view attached: the latest earlier executor that
        holds the branch's inherited text and was itself forked earlier in that text."""
        inherited = branch.text_[:branch.fork_point]
        for candidate in reversed(earlier[1:]):
            if candidate.fork_point < branch.fork_point and candidate.text_.startswith(inherited):
                return candidate.id
        return earlier[0].id

    # ---- lifecycle and text ----------------------------------------------------------------
    def close(self) -> None:
        """Stops updating and detaches from the program."""
        self._closed = True
        self._throttle.stop()
        if self._state.run.observer == self._on_event:
            self._state.observe(None)
        super().close()

    def __repr__(self) -> str:
        root = self.root
        lines = [f"ForkView: {len(self.branches)} branches, "
                 f"{'done' if self.done else 'running'}"]
        for panel in ([root] if root else []) + list(self.branches):
            text = "".join(f"[{s['var']}: {s['text']}]" if s["var"] else s["text"]
                           for s in panel["segments"])
            if len(text) > 300:
                text = "…" + text[-299:]
            lines.append(f"  {panel['label']} ({panel['status']}): {text!r}")
            if panel.get("error"):
                lines.append(f"    {panel['error']}")
        return "\n".join(lines)
