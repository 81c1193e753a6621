"""`RadixTreeView`: a Runtime's radix tree, colored by what changed since the last refresh
(SGLang paper, Figure 3)."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import anywidget
import traitlets

from lmnb.widgets.esm_helpers import ESM_HELPERS
from lmnb.widgets.poller import PollingWidget
from lmnb.widgets.saved_text import SavedText

STATES = ("root", "new", "hit", "locked", "evictable", "evicted")
_TRACKED = ("parent", "tokens", "lock_ref", "hit_count", "tier")  # a change here is a new refresh

_ESM = ESM_HELPERS + r"""
const NODE_W = 150, NODE_H = 30, COL = 180, ROW = 38, PAD = 8;
const LEGEND = [["new", "new since last refresh"], ["hit", "hit since last refresh"],
  ["evictable", "evictable (unlocked)"], ["locked", "locked (in use)"],
  ["evicted", "evicted since last refresh"]];

const short = (text, n) => {
  const t = (text || "").replace(/\n/g, "\u23ce").replace(/\s/g, " ");
  return t.length > n ? t.slice(0, n - 1) + "\u2026" : t;
};

function draw(model, canvas, info) {
  const nodes = model.get("nodes") || [];
  const edges = model.get("edges") || [];
  const summary = model.get("summary") || {};
  const pos = new Map();
  let w = 0, h = 0;
  for (const n of nodes) {
    const x = PAD + n.depth * COL, y = PAD + n.y * ROW;
    pos.set(n.id, [x, y]);
    w = Math.max(w, x + NODE_W + PAD);
    h = Math.max(h, y + NODE_H + PAD);
  }
  const s = svg("svg", { width: w, height: h, viewBox: `0 0 ${w} ${h}`, class: "lmnb-tree" });
  const byId = new Map(nodes.map((n) => [n.id, n]));
  for (const [parent, child] of edges) {
    const a = pos.get(parent), b = pos.get(child);
    if (!a || !b) continue;
    const x1 = a[0] + NODE_W, y1 = a[1] + NODE_H / 2, x2 = b[0], y2 = b[1] + NODE_H / 2;
    const mx = (x1 + x2) / 2;
    const state = (byId.get(child) || {}).state;
    s.append(svg("path", { d: `M${x1},${y1} C${mx},${y1} ${mx},${y2} ${x2},${y2}`,
      class: "lmnb-edge", "data-state": state, fill: "none" }));
  }
  for (const n of nodes) {
    const [x, y] = pos.get(n.id);
    const g = svg("g", { class: "lmnb-node", "data-state": n.state, "data-id": n.id,
      "data-locked": n.locked, transform: `translate(${x},${y})` });
    g.append(svg("rect", { width: NODE_W, height: NODE_H, rx: 4 }));
    const head = n.state === "root" ? "root" : `${n.tokens} tok \u00b7 ${n.state}`;
    g.append(svg("text", { x: 6, y: 12, class: "lmnb-node-head" }, head));
    g.append(svg("text", { x: 6, y: 25, class: "lmnb-node-text" }, short(n.text, 24)));
    g.append(svg("title", {}, `node ${n.id}: ${n.tokens} tokens, ${n.state}, ${n.tier}, ` +
      `lock_ref ${n.lock_ref}, hits ${n.hit_count}\n${n.text || ""}`));
    s.append(g);
  }
  canvas.replaceChildren(s);
  const hidden = summary.hidden ? `, ${summary.hidden} more nodes not drawn` : "";
  info.textContent = `${model.get("status")} \u00b7 refresh ${summary.refreshes ?? 0} \u00b7 ` +
    `${summary.nodes ?? 0} nodes, ${summary.tokens ?? 0} tokens` + hidden;
}

function render({ model, el }) {
  const box = node("div", "lmnb-radix");
  const legend = node("div", "lmnb-legend");
  for (const [state, label] of LEGEND) {
    const item = node("span", "lmnb-legend-item");
    item.dataset.state = state;
    const sw = svg("svg", { width: 14, height: 12 });
    sw.append(svg("rect", { x: 1, y: 1, width: 12, height: 10, rx: 2, class: "lmnb-swatch" }));
    item.append(sw, document.createTextNode(" " + label));
    legend.append(item);
  }
  const info = node("div", "lmnb-tree-info");
  const canvas = node("div", "lmnb-canvas");
  box.append(legend, info, canvas);
  el.append(box);
  const redraw = () => draw(model, canvas, info);
  const names = ["change:nodes", "change:edges", "change:summary", "change:status"];
  return redrawOn(model, names, redraw);
}

export default { render };
"""

_CSS = r"""
.lmnb-radix { font-family: var(--jp-ui-font-family, sans-serif); font-size: 12px;
  color: var(--jp-ui-font-color1, #222); }
.lmnb-radix .lmnb-legend { display: flex; flex-wrap: wrap; gap: 12px; margin-bottom: 2px; }
.lmnb-radix .lmnb-tree-info { font-size: 11px; color: var(--jp-ui-font-color2, #666); }
.lmnb-radix .lmnb-canvas { overflow: auto; max-height: 520px;
  border: 1px solid var(--jp-border-color2, #e5e5e5); }
.lmnb-radix .lmnb-node rect, .lmnb-radix .lmnb-swatch { stroke: #555; stroke-width: 1;
  fill: #f3f4f6; }
.lmnb-radix [data-state="root"] rect { fill: #e5e7eb; }
.lmnb-radix [data-state="new"] rect, .lmnb-radix [data-state="new"] .lmnb-swatch {
  fill: #86efac; }
.lmnb-radix [data-state="hit"] rect, .lmnb-radix [data-state="hit"] .lmnb-swatch {
  fill: #93c5fd; }
.lmnb-radix [data-state="locked"] rect, .lmnb-radix [data-state="locked"] .lmnb-swatch {
  fill: #fcd34d; }
.lmnb-radix [data-locked="true"] rect, .lmnb-radix [data-state="locked"] .lmnb-swatch {
  stroke-width: 2.5; stroke: #b45309; }
.lmnb-radix [data-state="evicted"] rect, .lmnb-radix [data-state="evicted"] .lmnb-swatch {
  fill: #f3f4f6; stroke: #dc2626; stroke-dasharray: 4 3; }
.lmnb-radix .lmnb-node[data-state="evicted"] { opacity: 0.55; }
.lmnb-radix .lmnb-edge { stroke: #888; stroke-width: 1.2; }
.lmnb-radix .lmnb-edge[data-state="evicted"] { stroke: #dc2626; stroke-dasharray: 4 3;
  opacity: 0.55; }
.lmnb-radix .lmnb-node-head { font-size: 10px; font-weight: 600; fill: #111; }
.lmnb-radix .lmnb-node-text { font-size: 10px; fill: #333;
  font-family: var(--jp-code-font-family, monospace); }
"""


def _states(rows: list[dict[str, Any]], before: dict[int, dict[str, Any]] | None) -> list[str]:
    """The state of each row relative to the previous refresh's rows `before`.

    A split cuts an old node's edge into a new upper node and the old node (the lower part): the
    upper node holds old tokens, so it is `hit` if its hit count (copied from the old node at the
    split) grew, not `new`.
    """
    if before is None:
        return ["root" if row["parent"] is None else "new" for row in rows]
    current = {row["id"]: row for row in rows}
    split_from: dict[int, int] = {}  # new upper node -> the old node it was cut from
    for row in rows:
        old = before.get(row["id"])
        if old is None or old["parent"] == row["parent"] or row["parent"] is None:
            continue
        parent = current.get(row["parent"])
        while parent is not None and parent["id"] not in before and parent["parent"] is not None:
            split_from[parent["id"]] = row["id"]
            parent = current.get(parent["parent"])
    states = []
    for row in rows:
        if row["parent"] is None:
            states.append("root")
            continue
        reference = before.get(row["id"])
        if reference is None and row["id"] in split_from:
            reference = before[split_from[row["id"]]]
        if reference is None:
            states.append("new")
        elif row["hit_count"] > reference["hit_count"]:
            states.append("hit")
        else:
            states.append("locked" if row["lock_ref"] > 0 else "evictable")
    return states


def tidy_layout(rows: list[dict[str, Any]]) -> dict[int, tuple[int, float]]:
    """(depth, y) per node: leaves on consecutive rows in child-id order, each parent centred
    on its children."""
    children: dict[int | None, list[int]] = {}
    for row in rows:
        children.setdefault(row["parent"], []).append(row["id"])
    roots = children.get(None, [])
    depth: dict[int, int] = {}
    ys: dict[int, float] = {}
    next_leaf = 0
    stack: list[tuple[int, bool]] = [(r, False) for r in reversed(roots)]
    for r in roots:
        depth[r] = 0
    while stack:  # iterative post-order: deep chains (long chats) need no recursion
        node_id, done = stack.pop()
        kids = sorted(children.get(node_id, []))
        if done:
            ys[node_id] = (ys[kids[0]] + ys[kids[-1]]) / 2
            continue
        if not kids:
            ys[node_id] = float(next_leaf)
            next_leaf += 1
            continue
        stack.append((node_id, True))
        for kid in reversed(kids):
            depth[kid] = depth[node_id] + 1
            stack.append((kid, False))
    return {n: (depth[n], ys[n]) for n in ys}


class RadixTreeView(SavedText, PollingWidget, anywidget.AnyWidget):
    """The radix tree of a `Runtime`'s prefix cache, drawn left to right, polled on a daemon
    thread (`interval_s=None`: only on `refresh()`).

    Node states compare with the previous refresh (a refresh happens when the tree changed):
    `new` (created since), `hit` (its hit count grew), `locked` (lock_ref > 0), `evictable`
    (lock_ref 0), `evicted` (gone since; drawn dashed for one refresh), and `root`. Node
    `locked` is lock_ref > 0 whatever the state. On the first refresh every node is new.

    Traits: `nodes` ([{id, parent, tokens, text, lock_ref, hit_count, namespace, state, locked,
    depth, y}]), `edges` ([[parent, child]]), `summary` ({refreshes, nodes, tokens, hidden, and a
    count per state}), `status`.
    """

    _esm = _ESM
    _css = _CSS
    nodes = traitlets.List(traitlets.Dict()).tag(sync=True)
    edges = traitlets.List(traitlets.List()).tag(sync=True)
    summary = traitlets.Dict().tag(sync=True)
    status = traitlets.Unicode("live").tag(sync=True)

    def __init__(self, runtime: Any, *, interval_s: float | None = 0.5, max_nodes: int = 400,
                 preview_tokens: int = 16) -> None:
        super().__init__()
        self._runtime: Any = runtime
        self._lock = threading.Lock()
        self._max_nodes = max_nodes
        self._preview_tokens = preview_tokens
        self._previous: dict[int, dict[str, Any]] | None = None
        self._refreshes = 0
        self.refresh()
        self.start_polling(interval_s)

    def refresh(self) -> bool:
        """Reads the runtime's tree and redraws it if it changed since the last refresh;
        False once the runtime is gone."""
        alive = self._poll()
        self.update_saved_text()
        return alive

    def _poll(self) -> bool:
        with self._lock:
            rows = self.read_runtime(lambda runtime: runtime.cache_snapshot(self._preview_tokens))
            if rows is None:
                return self._runtime is not None
            current = {row["id"]: row for row in rows}
            if self._previous is not None and self._same(current, self._previous):
                return True
            self._draw(rows, current)
            self._previous = current
            return True

    @staticmethod
    def _same(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]]) -> bool:
        return a.keys() == b.keys() and all(
            a[i].get(k) == b[i].get(k) for i in a for k in _TRACKED)

    def _draw(self, rows: list[dict[str, Any]], current: dict[int, dict[str, Any]]) -> None:
        before = self._previous
        root = next((row["id"] for row in rows if row["parent"] is None), None)
        drawn = [{**row, "state": state, "locked": row["lock_ref"] > 0}
                 for row, state in zip(rows, _states(rows, before), strict=True)]
        if before is not None:  # gone since the last refresh: drawn once more, dashed
            old_root = next((i for i, row in before.items() if row["parent"] is None), None)
            for node_id, row in before.items():
                if node_id in current or row["parent"] is None:
                    continue
                parent = root if row["parent"] == old_root else row["parent"]
                drawn.append({**row, "parent": parent, "state": "evicted", "locked": False})
            ids = {n["id"] for n in drawn}
            for n in drawn:
                if n["parent"] is not None and n["parent"] not in ids:
                    n["parent"] = root
        kept = self._first(drawn)
        layout = tidy_layout(kept)
        nodes = [{"id": n["id"], "parent": n["parent"], "tokens": n["tokens"], "text": n["text"],
                  "lock_ref": n["lock_ref"], "hit_count": n["hit_count"],
                  "namespace": _plain(n.get("namespace")), "state": n["state"],
                  "tier": n.get("tier", "device"),
                  "locked": n["locked"], "depth": layout[n["id"]][0], "y": layout[n["id"]][1]}
                 for n in kept]
        self._refreshes += 1
        summary: dict[str, Any] = {s: 0 for s in STATES}
        for n in nodes:
            summary[n["state"]] += 1
        summary.update(refreshes=self._refreshes, nodes=len(rows),
                       tokens=sum(row["tokens"] for row in rows),
                       hidden=len(drawn) - len(kept))
        with self.hold_sync():
            self.nodes = nodes
            self.edges = [[n["parent"], n["id"]] for n in nodes if n["parent"] is not None]
            self.summary = summary

    def _first(self, drawn: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """At most `max_nodes` nodes, breadth first from the root: always a connected tree."""
        if len(drawn) <= self._max_nodes:
            return drawn
        children: dict[Any, list[dict[str, Any]]] = {}
        for n in drawn:
            children.setdefault(n["parent"], []).append(n)
        kept: list[dict[str, Any]] = []
        queue = deque(children.get(None, []))
        while queue and len(kept) < self._max_nodes:
            n = queue.popleft()
            kept.append(n)
            queue.extend(children.get(n["id"], []))
        return kept

    # ---- lifecycle and text ----------------------------------------------------------------
    def __repr__(self) -> str:
        s = self.summary
        lines = [f"RadixTreeView ({self.status}): {s.get('nodes', 0)} nodes, "
                 f"{s.get('tokens', 0)} tokens; "
                 + ", ".join(f"{s.get(k, 0)} {k}" for k in STATES[1:])]
        children: dict[Any, list[dict[str, Any]]] = {}
        for n in self.nodes:
            children.setdefault(n["parent"], []).append(n)
        stack = list(reversed(children.get(None, [])))
        shown = 0
        while stack and shown < 40:  # depth first, as the tree is drawn
            n = stack.pop()
            stack.extend(reversed(children.get(n["id"], [])))
            if n["state"] == "root":
                continue
            text = n["text"] if len(n["text"]) <= 40 else n["text"][:39] + "…"
            lines.append(f"{'  ' * n['depth']}[{n['state']}] {n['tokens']} tok {text!r}")
            shown += 1
        if stack:
            lines.append("  …")
        return "\n".join(lines)


def _plain(value: Any) -> Any:
    """Namespaces are any hashable; the view needs JSON."""
    return value if value is None or isinstance(value, str | int | float | bool) else repr(value)
