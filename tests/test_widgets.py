"""Widgets: ForkView over a forked program, CacheDashboard and RadixTreeView over a live Runtime,
their synced state (what nbclient saves) and every widget's ESM (valid JavaScript that renders
in node against a minimal DOM)."""

from __future__ import annotations

import gc
import json
import shutil
import subprocess
import time
import weakref
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("anywidget")

import lmnb  # noqa: E402
from lmnb.widgets import (  # noqa: E402
    CacheDashboard,
    ForkView,
    MediaReuseView,
    RadixTreeView,
    TokenView,
)
from lmnb.widgets.esm_helpers import ESM_HELPERS  # noqa: E402
from lmnb.widgets.fork_view import segments  # noqa: E402
from lmnb.widgets.metrics_bar import MetricsBar  # noqa: E402
from lmnb.widgets.poller import PollingWidget  # noqa: E402
from lmnb.widgets.radix_tree_view import tidy_layout  # noqa: E402

GREEDY = {"temperature": 0, "ignore_eos": True}
GUARD_S = 60.0  # bounds a failing (hung) test only; no assertion depends on speed
PREFIX = "You are a careful assistant. Answer briefly and exactly. " * 3


@pytest.fixture(scope="module")
def folder(tiny_models):
    return tiny_models["llama-gqa"]


@pytest.fixture(scope="module")
def rt(folder):
    with lmnb.Runtime(folder, max_total_tokens=4096) as runtime:
        yield runtime


def _wait(condition: Callable[[], bool], timeout: float = GUARD_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _serializes(widget: Any) -> dict[str, Any]:
    state = widget.get_state()
    json.dumps(state)
    assert state["_esm"] and state["_css"]
    return state


@lmnb.function
def ideas(s, topic):
    s += "Topic: " + topic + "\n"
    forks = s.fork(3)
    forks += lambda i: f"Idea {i}:" + lmnb.gen("idea", max_tokens=12)
    forks.join()
    return forks


@lmnb.function
def nested(s):
    s += "Plan:"
    forks = s.fork(2)
    forks += lambda i: f" step {i}" + lmnb.gen("step", max_tokens=3)
    inner = forks[0].fork(2)
    inner += lambda i: f" detail {i}" + lmnb.gen("detail", max_tokens=3)
    forks[1] += lmnb.image("missing.png")  # text-only backend: this branch fails


# ---- ForkView ---------------------------------------------------------------------------------
def test_segments_cut_text_at_variable_spans():
    text = "abcXYZdefUV"
    assert segments(text, [("x", 3, 6), ("u", 9, 11)], start=1) == [
        {"text": "bc", "var": None}, {"text": "XYZ", "var": "x"}, {"text": "def", "var": None},
        {"text": "UV", "var": "u"}]
    assert segments(text, [("x", 3, 6)], start=6) == [{"text": "defUV", "var": None}]


def test_fork_view_streams_branches_until_done(rt):
    state = ideas.run(topic="cats", backend=rt, stream=True, **GREEDY)
    view = ForkView(state, title="ideas")
    _wait(lambda: view.done)  # no refresh(): the view's own updater got there
    state.sync()
    view.refresh()
    forks = state.ret_value
    assert [b["label"] for b in view.branches] == ["branch 1", "branch 2", "branch 3"]
    for branch, fork in zip(view.branches, forks, strict=True):
        assert branch["status"] == "done" and branch["error"] is None
        assert branch["parent"] == state.state_id
        start = fork.executor.fork_point
        assert "".join(seg["text"] for seg in branch["segments"]) == fork.text()[start:]
        marked = [seg for seg in branch["segments"] if seg["var"] is not None]
        assert marked == [{"text": fork["idea"], "var": "idea"}]
        assert marked[0]["text"]
    root = view.root
    assert root["label"] == "root" and root["status"] == "done"
    assert "".join(seg["text"] for seg in root["segments"]) == state.text()
    assert state["idea"] == [fork["idea"] for fork in forks]
    saved = _serializes(view)
    assert saved["branches"] == view.branches and saved["done"] is True
    text = repr(view)
    assert "branch 3 (done)" in text and f"[idea: {forks[0]['idea']}" in text
    assert view._repr_mimebundle_()[0]["text/plain"] == text
    view.close()
    assert state.run.observer is None


@lmnb.function
def dropped(s):
    s += "Topic:"
    forks = s.fork(2)  # not kept: their states are collected once the program returns
    forks += lambda i: f" idea {i}" + lmnb.gen("idea", max_tokens=4)
    forks.join()


def test_fork_view_done_when_branch_states_were_dropped(rt):
    state = dropped.run(backend=rt, stream=True, **GREEDY)
    view = ForkView(state)
    _wait(lambda: view.done)
    assert [b["status"] for b in view.branches] == ["done", "done"]
    assert len(state["idea"]) == 2
    view.close()


def test_fork_view_nested_forks_and_errors(rt):
    state = nested.run(backend=rt, stream=True, **GREEDY)
    view = ForkView(state)
    state.sync()
    for executor in state.run.executors:
        executor.sync()
    view.refresh()
    by_label = {b["label"]: b for b in view.branches}
    assert sorted(by_label) == ["branch 1", "branch 1.1", "branch 1.2", "branch 2"]
    assert by_label["branch 1.1"]["parent"] == by_label["branch 1"]["id"]
    assert by_label["branch 2"]["status"] == "error"
    assert "image()" in by_label["branch 2"]["error"]
    detail = [s for s in by_label["branch 1.2"]["segments"] if s["var"]]
    assert [s["var"] for s in detail] == ["detail"]
    assert view.done
    view.close()


# ---- CacheDashboard ---------------------------------------------------------------------------
def test_cache_dashboard_tracks_hits_pool_and_optimal(rt):
    assert rt.flush_cache()
    prompts = [PREFIX + f"Question {i}: what is {i} + {i}?" for i in range(4)]
    dash = CacheDashboard(rt, interval_s=0.05)
    assert dash.optimal is None and "n/a" in dash.optimal_note
    dash.set_workload(prompts)
    for prompt in prompts[:2]:
        dash.add_request(rt.generate(prompt, {"max_new_tokens": 4, **GREEDY}))
    dash.add_request(rt.generate(prompts[2:], {"max_new_tokens": 4, **GREEDY}))
    _wait(lambda: dash.series[-1]["prompt_tokens"] > 0)  # the poller saw the requests
    dash.refresh()
    stats = rt.stats()
    for key in ("max_total_tokens", "free_tokens", "evictable_tokens", "protected_tokens",
                "tree_nodes", "tree_tokens", "cached_tokens", "prompt_tokens", "evicted_tokens"):
        assert dash.stats[key] == stats[key], key
    last = dash.series[-1]
    assert last["used_tokens"] == stats["max_total_tokens"] - stats["free_tokens"]
    assert last["prompt_tokens"] == sum(len(rt.encode(p)) for p in prompts)
    assert any(point["hit_rate"] > 0 for point in dash.series)
    assert dash.optimal is not None and dash.optimal + 1e-9 >= last["hit_rate"] > 0
    assert [r["cached"] > 0 for r in dash.requests] == [False, True, True, True]
    assert sum(r["cached"] for r in dash.requests) == last["cached_tokens"]
    _serializes(dash)
    assert "optimal" in repr(dash) and "KV pool" in repr(dash)
    dash.close()
    assert not dash.polling and dash.status == "stopped"


def test_cache_dashboard_since_runtime_start(rt):
    prompt = PREFIX + "Question: what is 1 + 1?"
    rt.generate(prompt, {"max_new_tokens": 2, **GREEDY})
    rt.generate(prompt, {"max_new_tokens": 2, **GREEDY})
    fresh = CacheDashboard(rt, interval_s=None)
    total = CacheDashboard(rt, interval_s=None, since_runtime_start=True)
    stats = rt.stats()
    assert fresh.series[-1]["prompt_tokens"] == 0 and fresh.series[-1]["hit_rate"] == 0
    assert total.series[-1]["cached_tokens"] == stats["cached_tokens"] > 0
    assert total.series[-1]["hit_rate"] > 0 and total.scope == "since the runtime started"
    rt.generate(prompt, {"max_new_tokens": 2, **GREEDY})
    fresh.refresh()
    total.refresh()
    added = rt.stats()["prompt_tokens"] - stats["prompt_tokens"]
    assert fresh.series[-1]["prompt_tokens"] == added
    assert total.series[-1]["prompt_tokens"] == stats["prompt_tokens"] + added
    total.reset()  # an explicit reset counts from now, as a new dashboard does
    assert total.series[-1]["prompt_tokens"] == 0 and total.scope == fresh.scope
    fresh.close()
    total.close()


def test_widgets_let_go_of_a_closed_runtime(folder):
    runtime = lmnb.Runtime(folder, max_total_tokens=512)
    dash = CacheDashboard(runtime, interval_s=0.05)
    tree = RadixTreeView(runtime, interval_s=0.05)
    ref = weakref.ref(runtime)
    runtime.close()
    del runtime
    _wait(lambda: not dash.polling and not tree.polling)
    assert dash.status.startswith("stopped") and tree.status.startswith("stopped")
    gc.collect()
    assert ref() is None
    dash.refresh()
    tree.refresh()
    dash.close()
    tree.close()


# ---- RadixTreeView ----------------------------------------------------------------------------
def _shape(view: RadixTreeView) -> set[tuple[int, int | None, int]]:
    return {(n["id"], n["parent"], n["tokens"]) for n in view.nodes if n["state"] != "evicted"}


def _matches_snapshot(view: RadixTreeView, rt: Any) -> list[dict[str, Any]]:
    rows = rt.cache_snapshot()
    assert _shape(view) == {(r["id"], r["parent"], r["tokens"]) for r in rows}
    live = {n["id"] for n in view.nodes if n["state"] != "evicted"}
    assert {tuple(e) for e in view.edges if e[1] in live} == {
        (r["parent"], r["id"]) for r in rows if r["parent"] is not None}
    return rows


def test_radix_tree_view_states(rt):
    assert rt.flush_cache()
    view = RadixTreeView(rt, interval_s=None)
    assert [n["state"] for n in view.nodes] == ["root"]
    rt.generate(PREFIX + "First question?", {"max_new_tokens": 3, **GREEDY})
    view.refresh()
    _matches_snapshot(view, rt)
    # the prompt's node (inserted at prefill) and the output's below it
    assert sorted(n["state"] for n in view.nodes) == ["new", "new", "root"]
    first = next(n for n in view.nodes if n["state"] == "new" and n["depth"] == 1)
    assert first["tokens"] > 10 and first["text"]

    rt.generate(PREFIX + "Second question?", {"max_new_tokens": 3, **GREEDY})
    view.refresh()
    rows = _matches_snapshot(view, rt)
    states = {n["id"]: n["state"] for n in view.nodes}
    shared = next(r for r in rows if r["parent"] is not None and r["hit_count"] > 0)
    assert states[shared["id"]] == "hit"  # the prefix cut out of the first request's node
    assert states[first["id"]] == "evictable"  # its lower half, untouched
    assert list(states.values()).count("new") == 2  # the second request's prompt rest, output
    assert view.summary["hit"] == 1 and view.summary["refreshes"] == 3

    view.refresh()  # nothing changed: the view stays as it is
    assert view.summary["refreshes"] == 3

    before = {n["id"] for n in view.nodes if n["state"] != "root"}
    assert rt.flush_cache()
    view.refresh()
    _matches_snapshot(view, rt)
    assert {n["id"] for n in view.nodes if n["state"] == "evicted"} == before
    assert view.summary["evicted"] == len(before) == 5
    root = next(n["id"] for n in view.nodes if n["state"] == "root")
    ghosts = {n["id"]: n["parent"] for n in view.nodes if n["state"] == "evicted"}
    assert ghosts[shared["id"]] == root

    saved = _serializes(view)
    assert saved["nodes"] == view.nodes and saved["edges"] == view.edges
    assert "[evicted]" in repr(view)
    view.close()


class _FakeRuntime:
    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def cache_snapshot(self, preview_tokens: int = 16) -> list[dict[str, Any]]:
        return [dict(row) for row in self.rows]


def _row(node_id: int, parent: int | None, lock_ref: int = 0) -> dict[str, Any]:
    return {"id": node_id, "parent": parent, "tokens": 0 if parent is None else 4,
            "text": f"n{node_id}", "lock_ref": lock_ref, "last_access": 0.0, "hit_count": 0,
            "namespace": None}


def test_radix_tree_view_layout_locks_and_truncation():
    rows = [_row(0, None), _row(1, 0), _row(2, 1, lock_ref=1), _row(3, 1), _row(4, 0)]
    layout = tidy_layout(rows)
    assert layout == {0: (0, 1.25), 1: (1, 0.5), 2: (2, 0.0), 3: (2, 1.0), 4: (1, 2.0)}
    fake = _FakeRuntime(rows)
    view = RadixTreeView(fake, interval_s=None, max_nodes=3)
    assert [n["id"] for n in view.nodes] == [0, 1, 4] and view.summary["hidden"] == 2
    assert view.summary["nodes"] == 5
    fake.rows = [*rows[:4]]
    fake.rows[2] = {**rows[2], "lock_ref": 2}
    view._max_nodes = 100
    view.refresh()
    states = {n["id"]: n["state"] for n in view.nodes}
    assert states == {0: "root", 1: "evictable", 2: "locked", 3: "evictable", 4: "evicted"}
    assert next(n for n in view.nodes if n["id"] == 2)["locked"]
    view.close()


# ---- ESM ----------------------------------------------------------------------------------------
WIDGETS = [ForkView, CacheDashboard, RadixTreeView, MediaReuseView, TokenView, MetricsBar]


def _node() -> str:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    return node


@pytest.mark.parametrize("widget", WIDGETS)
def test_esm_is_valid_javascript(widget, tmp_path):
    path = tmp_path / f"{widget.__name__}.mjs"
    path.write_text(widget._esm)
    result = subprocess.run([_node(), "--check", str(path)], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0, result.stderr
    assert "export default" in widget._esm


@pytest.mark.parametrize("widget", WIDGETS)
def test_esm_starts_with_the_shared_helpers(widget):
    """One definition of `node`, `svg`, `pct`: the helpers, then the widget's own code."""
    assert widget._esm.startswith(ESM_HELPERS)
    own = widget._esm[len(ESM_HELPERS):]
    for helper in ("function node(", "function svg(", "const SVG ", "const pct "):
        assert helper not in own


_REDRAW_ON = r"""
const listeners = new Map();
const model = {
  on: (name, f) => listeners.set(name, [...(listeners.get(name) ?? []), f]),
  off: (name, f) => listeners.set(name, (listeners.get(name) ?? []).filter((g) => g !== f)),
};
const fire = (name) => { for (const f of listeners.get(name) ?? []) f(); };
let draws = 0;
const stop = redrawOn(model, ["change:a", "change:b"], () => { draws += 1; });
const seen = [draws];
fire("change:a"); fire("change:b"); fire("change:c");
seen.push(draws);
stop();
fire("change:a"); fire("change:b");
seen.push(draws, [...listeners.values()].flat().length);
console.log(JSON.stringify(seen));
"""


def test_redraw_on_draws_now_on_each_event_and_until_stopped(tmp_path):
    path = tmp_path / "redraw_on.mjs"
    path.write_text(ESM_HELPERS + _REDRAW_ON)
    result = subprocess.run([_node(), str(path)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [1, 3, 3, 0]  # draws now, then per event; none left


# A DOM just deep enough for the widgets' render functions (node has no `document`).
_FAKE_DOM = r"""
class El {
  constructor(tag, text) {
    Object.assign(this, { tagName: tag, children: [], parentElement: null, dataset: {},
      className: "", textContent: text ?? "", innerHTML: "", hidden: false, title: "",
      scrollTop: 0, scrollHeight: 0, clientHeight: 0, attrs: {} });
    this.style = { setProperty(k, v) { this[k] = v; } };
  }
  get firstChild() { return this.children[0] ?? null; }
  get lastChild() { return this.children[this.children.length - 1] ?? null; }
  append(...nodes) {
    for (const n of nodes) {
      if (n.tagName === "#fragment") { this.append(...n.children); n.children = []; continue; }
      n.remove();
      n.parentElement = this;
      this.children.push(n);
    }
  }
  replaceChildren(...nodes) {
    for (const n of [...this.children]) n.remove();
    this.append(...nodes);
  }
  remove() {
    const p = this.parentElement;
    if (p) p.children.splice(p.children.indexOf(this), 1);
    this.parentElement = null;
  }
  setAttribute(k, v) { this.attrs[k] = v; }
}
globalThis.document = {
  createElement: (tag) => new El(tag),
  createElementNS: (ns, tag) => new El(tag),
  createTextNode: (text) => new El("#text", text),
  createDocumentFragment: () => new El("#fragment"),
};
globalThis.requestAnimationFrame = (f) => setTimeout(f, 0);
"""

_RENDER = r"""
const state = JSON.parse(process.argv[2]);
const listeners = new Map();
const count = () => [...listeners.values()].reduce((n, s) => n + s.size, 0);
const model = {
  get: (name) => state[name],
  on: (name, f) => { if (!listeners.has(name)) listeners.set(name, new Set());
    listeners.get(name).add(f); },
  off: (name, f) => listeners.get(name)?.delete(f),
  send: () => {},
};
const el = new El("div");
const cleanup = widget.render({ model, el });
for (const [name, fs] of listeners) {
  if (name.startsWith("change:")) for (const f of [...fs]) f();
}
await new Promise((done) => setTimeout(done, 10));
const drawn = JSON.stringify(el, (k, v) => (k === "parentElement" ? undefined : v));
const subscribed = count();
cleanup();
console.log(JSON.stringify({ subscribed, after: count(), drawn }));
"""

_FORK = {"title": "ideas", "done": True,
         "root": {"id": 0, "label": "root", "status": "done", "error": None,
                  "segments": [{"text": "Topic: ", "var": None}, {"text": "tea", "var": "topic"}]},
         "branches": [{"id": 1, "label": "branch 1", "status": "error", "error": "ValueError: x",
                       "parent": 0, "fork_point": 7,
                       "segments": [{"text": "Idea", "var": "idea"}]}]}
_DASHBOARD = {"series": [{"t": 0.5, "hit_rate": 0.5, "recent_hit_rate": 0.25, "prompt_tokens": 40,
                          "cached_tokens": 20, "media_tokens": 8, "cached_media_tokens": 4,
                          "d_prompt": 10, "d_cached": 5, "evicted_tokens": 3}],
              "stats": {"max_total_tokens": 100, "free_tokens": 50, "protected_tokens": 10,
                        "evictable_tokens": 20, "hicache_host_capacity": 64,
                        "hicache_device_tokens": 1, "hicache_host_tokens": 2,
                        "hicache_host_loaded_tokens": 3, "hicache_disk_loaded_tokens": 4,
                        "speculative": {"accept_rate": 0.5, "mean_accept_length": 1.5,
                                        "algorithm": "ngram", "verify_passes": 2, "state": "on"}},
              "optimal": 0.75, "requests": [{"prompt": 10, "cached": 5}]}
_TREE = {"nodes": [{"id": 0, "parent": None, "tokens": 0, "text": "", "state": "root",
                    "locked": False, "depth": 0, "y": 0.5, "tier": "device", "lock_ref": 0,
                    "hit_count": 0},
                   {"id": 1, "parent": 0, "tokens": 4, "text": "hello\nworld", "state": "hit",
                    "locked": True, "depth": 1, "y": 0.0, "tier": "device", "lock_ref": 1,
                    "hit_count": 2}],
         "edges": [[0, 1]], "summary": {"refreshes": 2, "nodes": 2, "tokens": 4}}
_MEDIA = {"items": [{"hash": "ab" * 16, "short_hash": "abababab", "kind": "image",
                     "num_tokens": 576, "requests": 2, "hits": 1, "resident": True,
                     "size": [3, 4], "thumbnail": "data:image/png;base64,", "change": "hit"},
                    {"hash": "cd" * 16, "short_hash": "cdcdcdcd", "kind": "video",
                     "num_tokens": 1000, "requests": 1, "hits": 0, "resident": False,
                     "size": None, "thumbnail": None, "change": "new"}],
          "summary": {"media": 2, "resident": 1, "evicted": 1, "media_tokens": 1576,
                      "cached_media_tokens": 576, "media_hit_rate": 0.37}}
_TOKEN_ROWS = {"0": [["Hi", 0, None, []], [" there", 2, -0.5, [[" you", -1.2]]]]}
_TOKENS = {"rows": [{"id": 0, "label": "root", "status": "done", "tail": ""}],
           "snapshot": json.dumps({"seq": 0, "rows": _TOKEN_ROWS})}
_SAMPLES: dict[type, tuple[dict[str, Any], str]] = {  # a state, and a text its drawing holds
    ForkView: (_FORK, "ValueError: x"), CacheDashboard: (_DASHBOARD, "50.0%"),
    RadixTreeView: (_TREE, "4 tok \u00b7 hit"), MediaReuseView: (_MEDIA, "1 of 2 requests hit"),
    TokenView: (_TOKENS, " there"), MetricsBar: ({"html": "<b>metrics</b>"}, "<b>metrics</b>"),
}


@pytest.mark.parametrize("widget", WIDGETS)
def test_esm_renders_redraws_and_lets_go(widget, tmp_path):
    """Each front end draws its state, redraws on every trait change it listens to, and its
    cleanup removes every listener it added (node, with a minimal DOM)."""
    defaults = {name: trait.default()
                for name, trait in widget.class_own_traits(sync=True).items()
                if not name.startswith("_")}
    esm = widget._esm.replace("export default { render };", "const widget = { render };")
    path = tmp_path / f"{widget.__name__}.mjs"
    path.write_text(_FAKE_DOM + esm + _RENDER)
    sample, shown = _SAMPLES[widget]
    for state, text in ((defaults, ""), ({**defaults, **sample}, shown)):
        result = subprocess.run([_node(), str(path), json.dumps(state)], capture_output=True,
                                text=True, timeout=30)
        assert result.returncode == 0, result.stderr
        out = json.loads(result.stdout)
        assert out["subscribed"] > 0 and out["after"] == 0
        assert json.loads(out["drawn"])["children"] and text in out["drawn"]


class _FakeStats:
    def __init__(self) -> None:
        self.calls = 0
        self.closed = False
        self.flaky = False
        self.failed = False

    def stats(self) -> dict[str, Any]:
        if self.closed or self.flaky:
            raise RuntimeError("this Runtime is closed" if self.closed else "Already borrowed")
        self.calls += 1
        keys = ("evicted_tokens", "eviction_events", "evictable_tokens", "protected_tokens",
                "running", "waiting")
        return {"prompt_tokens": 10 * self.calls, "cached_tokens": 5 * self.calls,
                "recent_cache_hit_rate": 0.5, "max_total_tokens": 100, "free_tokens": 90,
                **dict.fromkeys(keys, 0)}


def test_cache_dashboard_thins_its_series_and_stops_on_a_closed_runtime():
    fake = _FakeStats()
    dash = CacheDashboard(fake, interval_s=None, max_points=10)
    for _ in range(40):
        dash.refresh()
    assert len(dash.series) <= 10
    times = [p["t"] for p in dash.series]
    assert times == sorted(times) and dash.series[-1]["prompt_tokens"] == 400
    assert dash.series[-1]["hit_rate"] == 0.5 and dash.series[-1]["d_prompt"] == 10
    fake.flaky = True  # a passing error: polling goes on
    dash.refresh()
    assert dash.status == "live" and dash.series[-1]["prompt_tokens"] == 400
    fake.closed = True
    dash.refresh()
    assert dash.status.startswith("stopped") and dash._runtime is None
    dash.close()


class _FakePolled(_FakeStats):
    """Every reader a polling widget calls, each failing like `stats()`."""

    def cache_snapshot(self, preview_tokens: int = 16) -> list[dict[str, Any]]:
        self.stats()
        return [_row(0, None), _row(1, 0)]

    def media_snapshot(self) -> list[dict[str, Any]]:
        self.stats()
        return []


class _Reader(PollingWidget):
    def __init__(self, runtime: Any) -> None:
        self._runtime = runtime
        self.status = "live"
        self.polls = 0

    def _poll(self) -> bool:
        self.polls += 1
        return self.polls < 3


@pytest.mark.parametrize(("runtime", "interval_s"), [(None, 0.05), (_FakeStats(), None)])
def test_start_polling_without_a_runtime_or_an_interval_polls_never(runtime, interval_s):
    reader = _Reader(runtime)
    reader.start_polling(interval_s)
    assert reader._poller is None and not reader.polling


def test_a_widget_that_never_started_polling_stops_and_reports_not_polling():
    """A widget whose construction failed before `start_polling` (its first `refresh()` raised)
    is still closed by its finaliser: stopping needs no poller."""
    reader = _Reader(_FakeStats())
    assert not reader.polling
    reader.stop_polling("stopped")
    assert reader.status == "stopped"


def test_start_polling_polls_until_poll_says_the_runtime_is_gone():
    reader = _Reader(_FakeStats())
    reader.start_polling(0.05)
    _wait(lambda: not reader.polling)
    assert reader.polls == 3


def test_read_runtime_reads_retries_a_passing_error_and_lets_go_of_a_failed_runtime():
    fake = _FakeStats()
    reader = _Reader(fake)
    assert reader.read_runtime(lambda runtime: runtime.stats())["prompt_tokens"] == 10
    fake.flaky = True  # "Already borrowed": the next poll reads again
    assert reader.read_runtime(lambda runtime: runtime.stats()) is None
    assert reader._runtime is fake and reader.status == "live"
    fake.failed = True  # the error is for good
    assert reader.read_runtime(lambda runtime: runtime.stats()) is None
    assert reader._runtime is None and reader.status == "stopped: the runtime is closed"
    fake.flaky = fake.failed = False
    assert reader.read_runtime(lambda runtime: runtime.stats()) is None  # let go: never read
    assert fake.calls == 1


@pytest.mark.parametrize("widget", [CacheDashboard, RadixTreeView, MediaReuseView, MetricsBar])
def test_polling_widgets_poll_on_through_a_passing_error_and_stop_on_a_closed_runtime(widget):
    fake = _FakePolled()
    view = widget(fake, interval_s=None)
    shown = view.get_state()
    fake.flaky = True
    assert view._poll() and view.status == "live" and view._runtime is fake
    assert view.get_state() == shown
    fake.flaky, fake.closed = False, True
    assert not view._poll()
    assert view.status == "stopped: the runtime is closed" and view._runtime is None
    assert not view._poll()
    view.close()
