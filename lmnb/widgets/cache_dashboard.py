"""`CacheDashboard`: prefix-cache hit rate (achieved vs optimal), per-request reuse, KV pool use,
evictions and (LLaVA) image/video tokens served from cache of a `Runtime`, updating live."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import anywidget
import traitlets

from lmnb.widgets.esm_helpers import ESM_HELPERS
from lmnb.widgets.poller import PollingWidget
from lmnb.widgets.saved_text import SavedText

_GAUGES = ("cache_hit_rate", "recent_cache_hit_rate", "prompt_tokens", "cached_tokens",
           "generated_tokens", "forward_passes", "retractions", "evicted_tokens",
           "eviction_events", "tree_nodes", "tree_tokens", "evictable_tokens", "protected_tokens",
           "max_total_tokens", "free_tokens", "running", "waiting", "media_tokens",
           "cached_media_tokens", "speculative", "hicache_device_tokens", "hicache_host_tokens",
           "hicache_host_capacity", "hicache_host_loaded_tokens", "hicache_disk_loaded_tokens",
           "hicache_disk_bytes")
_COUNTED = ("prompt_tokens", "cached_tokens", "media_tokens", "cached_media_tokens")

_SINCE_CREATED = "since this dashboard started"
_SINCE_RUNTIME = "since the runtime started"

_ESM = ESM_HELPERS + r"""
function card(parent, label, cls) {
  const c = node("div", "lmnb-card " + cls);
  const value = node("div", "lmnb-value");
  c.append(node("div", "lmnb-card-label", label), value);
  parent.append(c);
  return value;
}

function chart(title) {
  const box = node("div", "lmnb-chart");
  box.append(node("div", "lmnb-chart-title", title));
  const s = svg("svg", { viewBox: "0 0 320 140", width: "100%", preserveAspectRatio: "none" });
  box.append(s);
  return { box, s };
}

const W = 320, H = 140, L = 34, R = 6, T = 6, B = 18;

function axes(s, ymax, fmt) {
  s.append(svg("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "lmnb-axis" }));
  s.append(svg("line", { x1: L, y1: T, x2: L, y2: H - B, class: "lmnb-axis" }));
  s.append(svg("text", { x: L - 3, y: T + 8, class: "lmnb-tick", "text-anchor": "end" },
    fmt(ymax)));
  s.append(svg("text", { x: L - 3, y: H - B, class: "lmnb-tick", "text-anchor": "end" }, fmt(0)));
}

function line(s, xs, ys, xmax, ymax, cls) {
  if (!xs.length) return;
  const sx = (x) => L + (W - L - R) * (xmax > 0 ? x / xmax : 0);
  const sy = (y) => H - B - (H - B - T) * (ymax > 0 ? y / ymax : 0);
  const pts = xs.map((x, i) => `${sx(x).toFixed(1)},${sy(ys[i]).toFixed(1)}`).join(" ");
  s.append(svg("polyline", { points: pts, class: cls, fill: "none" }));
}

function hitChart(c, series, optimal) {
  c.s.replaceChildren();
  axes(c.s, 1, (v) => (100 * v).toFixed(0) + "%");
  const xs = series.map((p) => p.t);
  const xmax = Math.max(1e-9, ...xs);
  line(c.s, xs, series.map((p) => p.hit_rate), xmax, 1, "lmnb-achieved");
  line(c.s, xs, series.map((p) => p.recent_hit_rate), xmax, 1, "lmnb-recent");
  if (optimal !== null && optimal !== undefined) {
    const y = H - B - (H - B - T) * optimal;
    c.s.append(svg("line", { x1: L, y1: y, x2: W - R, y2: y, class: "lmnb-optimal-line" }));
  }
  c.s.append(svg("text", { x: W - R, y: H - 4, class: "lmnb-tick", "text-anchor": "end" },
    xmax.toFixed(1) + " s"));
}

function barChart(c, bars) {
  c.s.replaceChildren();
  const ymax = Math.max(1, ...bars.map((b) => b.prompt));
  axes(c.s, ymax, (v) => String(Math.round(v)));
  const n = Math.max(bars.length, 1), bw = (W - L - R) / n;
  bars.forEach((b, i) => {
    const x = L + i * bw + 0.1 * bw, w = Math.max(0.8 * bw, 0.5);
    const hp = (H - B - T) * b.prompt / ymax, hc = (H - B - T) * b.cached / ymax;
    const bar = svg("rect", { x, y: H - B - hp, width: w, height: hp, class: "lmnb-computed" });
    bar.append(svg("title", {}, `${b.label}: ${b.cached} of ${b.prompt} prompt tokens cached`));
    c.s.append(bar);
    c.s.append(svg("rect", { x, y: H - B - hc, width: w, height: hc, class: "lmnb-cached" }));
  });
}

function poolBar(box, st) {
  box.replaceChildren();
  const total = st.max_total_tokens || 0;
  if (!total) return;
  const locked = st.protected_tokens || 0, evictable = st.evictable_tokens || 0;
  const free = st.free_tokens || 0;
  const running = Math.max(0, total - free - locked - evictable);
  const parts = [["locked", locked], ["running", running], ["evictable", evictable],
    ["free", free]];
  const bar = node("div", "lmnb-pool-bar");
  const legend = node("div", "lmnb-pool-legend");
  for (const [name, value] of parts) {
    const seg = node("div", "lmnb-pool-" + name);
    seg.style.width = (100 * value / total).toFixed(2) + "%";
    seg.title = `${name}: ${value} tokens`;
    bar.append(seg);
    const item = node("span", "lmnb-pool-item");
    item.append(node("i", "lmnb-pool-" + name), document.createTextNode(` ${name} ${value}`));
    legend.append(item);
  }
  box.append(bar, legend);
}

function render({ model, el }) {
  const box = node("div", "lmnb-dashboard");
  const status = node("div", "lmnb-dash-status");
  const cards = node("div", "lmnb-cards");
  const achieved = card(cards, "hit rate", "lmnb-hit-rate");
  const optimal = card(cards, "optimal", "lmnb-optimal");
  const reqs = card(cards, "cached / prompt tokens", "lmnb-tokens");
  const evictions = card(cards, "evicted tokens (events)", "lmnb-evictions");
  const queue = card(cards, "running / waiting", "lmnb-queue");
  const media = card(cards, "image/video tokens cached", "lmnb-media-tokens");
  media.parentElement.style.display = "none";
  const spec = card(cards, "speculative drafts accepted", "lmnb-spec");
  spec.parentElement.style.display = "none";
  const tiers = card(cards, "tiers: device / host / disk (tokens hit from host, disk)",
    "lmnb-tiers");
  tiers.parentElement.style.display = "none";
  const charts = node("div", "lmnb-charts");
  const hits = chart("hit rate over time: achieved (solid), recent (thin), optimal (dashed)");
  const bars = chart("");
  const evict = chart("evicted tokens over time");
  charts.append(hits.box, bars.box, evict.box);
  const pool = node("div", "lmnb-pool");
  const poolTitle = node("div", "lmnb-chart-title");
  const poolBox = node("div");
  pool.append(poolTitle, poolBox);
  box.append(status, cards, pool, charts);
  el.append(box);

  const draw = () => {
    const series = model.get("series") || [];
    const st = model.get("stats") || {};
    const opt = model.get("optimal");
    const last = series.length ? series[series.length - 1] : null;
    status.textContent = `${model.get("status")}; counts ${model.get("scope")}`;
    box.dataset.status = model.get("status");
    achieved.textContent = last ? pct(last.hit_rate) : "n/a";
    optimal.textContent = pct(opt);
    optimal.title = model.get("optimal_note") || "";
    reqs.textContent = last ? `${last.cached_tokens} / ${last.prompt_tokens}` : "n/a";
    evictions.textContent = `${st.evicted_tokens ?? 0} (${st.eviction_events ?? 0})`;
    queue.textContent = `${st.running ?? 0} / ${st.waiting ?? 0}`;
    const mediaSeen = last && last.media_tokens > 0;
    media.parentElement.style.display = mediaSeen ? "" : "none";
    media.textContent = mediaSeen ? `${last.cached_media_tokens} / ${last.media_tokens}` : "n/a";
    const sp = st.speculative;
    spec.parentElement.style.display = sp ? "" : "none";
    if (sp) {
      spec.textContent = `${pct(sp.accept_rate)}, ${sp.mean_accept_length.toFixed(2)} tok/pass`;
      spec.title = `${sp.algorithm}: ${sp.verify_passes} verify passes; ${sp.state}`;
    }
    const tiered = st.hicache_host_capacity !== undefined;
    tiers.parentElement.style.display = tiered ? "" : "none";
    tiers.textContent = tiered ? `${st.hicache_device_tokens} / ${st.hicache_host_tokens} / ` +
      `${((st.hicache_disk_bytes ?? 0) / 2 ** 20).toFixed(1)} MiB ` +
      `(${st.hicache_host_loaded_tokens}, ${st.hicache_disk_loaded_tokens})` : "n/a";
    hitChart(hits, series, opt);
    const requests = model.get("requests") || [];
    let barData;
    if (requests.length) {
      bars.box.firstChild.textContent = "cached (dark) vs computed prompt tokens per request";
      barData = requests.slice(-60).map((r, i) => ({ ...r, label: `request ${i + 1}` }));
    } else {
      bars.box.firstChild.textContent = "cached (dark) vs computed prompt tokens per update";
      barData = series.filter((p) => p.d_prompt > 0).slice(-60).map((p) => (
        { prompt: p.d_prompt, cached: p.d_cached, label: `t=${p.t.toFixed(1)} s` }));
    }
    barChart(bars, barData);
    evict.s.replaceChildren();
    const ev = series.map((p) => p.evicted_tokens);
    const emax = Math.max(1, ...ev);
    axes(evict.s, emax, (v) => String(Math.round(v)));
    line(evict.s, series.map((p) => p.t), ev, Math.max(1e-9, ...series.map((p) => p.t)), emax,
      "lmnb-evicted-line");
    poolTitle.textContent = `KV pool: ${st.max_total_tokens ?? 0} tokens, ` +
      `${st.free_tokens ?? 0} free; radix tree ${st.tree_nodes ?? 0} nodes / ` +
      `${st.tree_tokens ?? 0} tokens`;
    poolBar(poolBox, st);
  };
  const names = ["change:series", "change:stats", "change:optimal", "change:requests",
    "change:status", "change:scope"];
  return redrawOn(model, names, draw);
}

export default { render };
"""

_CSS = r"""
.lmnb-dashboard { font-family: var(--jp-ui-font-family, sans-serif); font-size: 12px;
  color: var(--jp-ui-font-color1, #222); }
.lmnb-dashboard .lmnb-dash-status { color: var(--jp-ui-font-color2, #666); font-size: 11px; }
.lmnb-dashboard .lmnb-cards { display: flex; flex-wrap: wrap; gap: 8px; margin: 4px 0; }
.lmnb-dashboard .lmnb-card { border: 1px solid var(--jp-border-color1, #ccc); border-radius: 4px;
  padding: 4px 8px; min-width: 90px; }
.lmnb-dashboard .lmnb-card-label { font-size: 11px; color: var(--jp-ui-font-color2, #666); }
.lmnb-dashboard .lmnb-value { font-size: 16px; font-weight: 600; }
.lmnb-dashboard .lmnb-charts { display: flex; flex-wrap: wrap; gap: 8px; }
.lmnb-dashboard .lmnb-chart { flex: 1 1 300px; max-width: 480px; }
.lmnb-dashboard .lmnb-chart-title { font-size: 11px; margin: 4px 0 2px; }
.lmnb-dashboard svg { background: var(--jp-layout-color1, #fff); height: 140px; }
.lmnb-dashboard .lmnb-axis { stroke: #999; stroke-width: 1; }
.lmnb-dashboard .lmnb-tick { font-size: 9px; fill: #777; }
.lmnb-dashboard .lmnb-achieved { stroke: #2563eb; stroke-width: 2; }
.lmnb-dashboard .lmnb-recent { stroke: #93c5fd; stroke-width: 1; }
.lmnb-dashboard .lmnb-optimal-line { stroke: #16a34a; stroke-width: 1.5; stroke-dasharray: 5 3; }
.lmnb-dashboard .lmnb-evicted-line { stroke: #dc2626; stroke-width: 1.5; }
.lmnb-dashboard .lmnb-computed { fill: #cbd5e1; }
.lmnb-dashboard .lmnb-cached { fill: #2563eb; }
.lmnb-dashboard .lmnb-pool-bar { display: flex; height: 14px; border: 1px solid #999;
  border-radius: 3px; overflow: hidden; max-width: 640px; }
.lmnb-dashboard .lmnb-pool-legend { display: flex; gap: 10px; font-size: 11px; margin-top: 2px; }
.lmnb-dashboard .lmnb-pool-legend i { display: inline-block; width: 10px; height: 10px; }
.lmnb-dashboard .lmnb-pool-locked { background: #f59e0b; }
.lmnb-dashboard .lmnb-pool-running { background: #a855f7; }
.lmnb-dashboard .lmnb-pool-evictable { background: #60a5fa; }
.lmnb-dashboard .lmnb-pool-free { background: #e5e7eb; }
"""


def _meta_info(request: Mapping[str, Any]) -> Mapping[str, Any]:
    return request.get("meta_info", request)


def _tiers_line(st: Mapping[str, Any]) -> str:
    disk = (f"; disk {st['hicache_disk_bytes'] / 2**20:.1f} MiB"
            if "hicache_disk_bytes" in st else "")
    return (f"  tiers: device {st['hicache_device_tokens']} tokens, host "
            f"{st['hicache_host_tokens']} of {st['hicache_host_capacity']}{disk}; hits loaded "
            f"from host {st['hicache_host_loaded_tokens']}, from disk "
            f"{st['hicache_disk_loaded_tokens']} tokens")


class CacheDashboard(SavedText, PollingWidget, anywidget.AnyWidget):
    """Live prefix-cache statistics of a `Runtime`, polled on a daemon thread every `interval_s`
    (None: only on `refresh()`).

    The hit rate is over the requests admitted since the dashboard was created (or `reset()`),
    so that it compares with `optimal`, the best hit rate any order could reach on the workload's
    prompts (SGLang Theorem 3.1) once given by `prompts=` or `set_workload()`. Optimal assumes
    the cache held none of the workload when it began. With `since_runtime_start=True` (what
    `%lmnb status` shows) the counts start with the runtime's totals instead, and go on live.

    Reuse per request: callers push each request's `meta_info` (or the whole `generate` result)
    with `add_request()`; without that, the bars show the prompt tokens admitted between updates
    (from the runtime's counters).

    Traits: `series` (points {t, hit_rate, recent_hit_rate, prompt_tokens, cached_tokens,
    media_tokens, cached_media_tokens (image/video span tokens among them), d_prompt, d_cached,
    used_tokens, free_tokens, evictable_tokens, protected_tokens, evicted_tokens,
    eviction_events, running, waiting}), `stats` (the latest `Runtime.stats()`),
    `optimal` (float or None), `optimal_note`, `requests` ([{prompt, cached}]), `status`,
    `scope` (what the counts cover, in words).
    """

    _esm = _ESM
    _css = _CSS
    series = traitlets.List(traitlets.Dict()).tag(sync=True)
    stats = traitlets.Dict().tag(sync=True)
    optimal = traitlets.Float(None, allow_none=True).tag(sync=True)
    optimal_note = traitlets.Unicode("optimal: n/a (no workload prompts given)").tag(sync=True)
    requests = traitlets.List(traitlets.Dict()).tag(sync=True)
    status = traitlets.Unicode("live").tag(sync=True)
    scope = traitlets.Unicode(_SINCE_CREATED).tag(sync=True)

    def __init__(self, runtime: Any, *, prompts: Sequence[Sequence[int] | str] | None = None,
                 interval_s: float | None = 0.1, max_points: int = 400,
                 max_requests: int = 500, since_runtime_start: bool = False) -> None:
        super().__init__()
        self._runtime: Any = runtime
        self._lock = threading.Lock()
        self._max_points = max_points
        self._max_requests = max_requests
        self._start = time.monotonic()
        self._base: dict[str, Any] = {}
        self._last: dict[str, Any] | None = None
        with self._lock:
            self._read_now()
        self.reset()
        if since_runtime_start:
            self._start_from_runtime_start()
        if prompts is not None:
            self.set_workload(prompts)
        self.start_polling(interval_s)

    # ---- inputs ----------------------------------------------------------------------------
    def reset(self) -> None:
        """Starts a new series: the hit rate counts requests admitted from now on."""
        with self._lock:
            stats = self._last or {}
            self._base = {k: stats.get(k, 0) for k in _COUNTED}
            self._start = time.monotonic()
            with self.hold_sync():
                self.scope = _SINCE_CREATED
                self.stats = dict(stats)
                self.series = [self._point(stats, stats)] if stats else []
                self.requests = []

    def _start_from_runtime_start(self) -> None:
        """The counters are the runtime's own (cumulative since it started): no baseline."""
        with self._lock:
            stats = self._last or {}
            self._base = {}
            with self.hold_sync():
                self.scope = _SINCE_RUNTIME
                self.series = [self._point(stats, stats)] if stats else []

    def set_workload(self, prompts: Sequence[Sequence[int] | str]) -> None:
        """The workload's prompts (token id lists, or strings encoded with the runtime's
        tokenizer) whose optimal hit rate is drawn next to the achieved one."""
        runtime = self._runtime
        if runtime is None and any(isinstance(p, str) for p in prompts):
            raise ValueError("the runtime is gone: give the prompts as token id lists")
        ids = [runtime.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        try:
            from lmnb.runtime.radix.optimal import optimal_hit_rate
        except ImportError:
            with self._lock, self.hold_sync():
                self.optimal = None
                self.optimal_note = "optimal: n/a (lmnb.runtime.radix.optimal is missing)"
            return
        optimal = optimal_hit_rate(ids)
        with self._lock, self.hold_sync():
            self.optimal = optimal
            self.optimal_note = (f"optimal over {len(ids)} prompts, "
                                 f"{sum(map(len, ids))} tokens (Theorem 3.1)")

    def add_request(self, request: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Records finished requests' reuse from their `meta_info`, a `generate` result, or a
        list of either (a batch)."""
        requests = [request] if isinstance(request, Mapping) else list(request)
        entries = [{"prompt": int(meta["prompt_tokens"]), "cached": int(meta["cached_tokens"])}
                   for meta in map(_meta_info, requests)]
        with self._lock:
            self.requests = [*self.requests, *entries][-self._max_requests:]

    # ---- polling ---------------------------------------------------------------------------
    def _read_now(self) -> bool:
        stats = self.read_runtime(lambda runtime: runtime.stats())
        if stats is None:
            return self._runtime is not None
        self._last = {k: stats[k] for k in _GAUGES if k in stats}
        return True

    def _update(self, *, force: bool) -> bool:
        with self._lock:
            previous = self._last
            if not self._read_now():
                return False
            if self._last is None:
                return True
            if force or self._last != previous:
                point = self._point(self._last, previous or self._last)
                with self.hold_sync():
                    self.stats = dict(self._last)
                    self.series = self._extended(point)
            return True

    def _extended(self, point: dict[str, Any]) -> list[dict[str, Any]]:
        """The series plus `point`; past `max_points`, the older half is thinned to every other
        point, so the chart keeps the whole run at a coarser resolution."""
        series = [*self.series, point]
        if len(series) > self._max_points:
            half = len(series) // 2
            series = series[:half:2] + series[half:]
        return series

    def _poll(self) -> bool:
        return self._update(force=False)

    def refresh(self) -> None:
        """Reads the runtime's stats and updates the view now."""
        self._update(force=True)
        self.update_saved_text()

    def _point(self, stats: dict[str, Any], previous: dict[str, Any]) -> dict[str, Any]:
        prompt = stats["prompt_tokens"] - self._base.get("prompt_tokens", 0)
        cached = stats["cached_tokens"] - self._base.get("cached_tokens", 0)
        # image/video span tokens among those (LLaVA runtimes; 0 for text models)
        media = stats.get("media_tokens", 0) - self._base.get("media_tokens", 0)
        cached_media = (stats.get("cached_media_tokens", 0)
                        - self._base.get("cached_media_tokens", 0))
        return {
            "t": round(time.monotonic() - self._start, 3),
            "hit_rate": cached / prompt if prompt > 0 else 0.0,
            "recent_hit_rate": stats["recent_cache_hit_rate"],
            "prompt_tokens": prompt, "cached_tokens": cached,
            "media_tokens": media, "cached_media_tokens": cached_media,
            "d_prompt": stats["prompt_tokens"] - previous["prompt_tokens"],
            "d_cached": stats["cached_tokens"] - previous["cached_tokens"],
            "used_tokens": stats["max_total_tokens"] - stats["free_tokens"],
            **{k: stats[k] for k in ("free_tokens", "evictable_tokens", "protected_tokens",
                                     "evicted_tokens", "eviction_events", "running",
                                     "waiting")},
        }

    # ---- lifecycle and text ----------------------------------------------------------------
    def __repr__(self) -> str:
        st = self.stats
        last = self.series[-1] if self.series else None
        hit = f"{100 * last['hit_rate']:.1f}%" if last else "n/a"
        optimal = f"{100 * self.optimal:.1f}%" if self.optimal is not None else "n/a"
        lines = [f"CacheDashboard ({self.status}): hit rate {hit}, optimal {optimal}"]
        if last:
            lines.append(f"  cached {last['cached_tokens']} of {last['prompt_tokens']} prompt "
                         f"tokens {self.scope}; {len(self.requests)} requests recorded")
            if last.get("media_tokens"):
                lines.append(f"  image/video tokens: cached {last['cached_media_tokens']} of "
                             f"{last['media_tokens']}")
        if st:
            lines.append(f"  KV pool {st['max_total_tokens']} tokens: {st['free_tokens']} free, "
                         f"{st['evictable_tokens']} evictable, {st['protected_tokens']} locked; "
                         f"evicted {st['evicted_tokens']} tokens in {st['eviction_events']} "
                         f"events; running {st['running']}, waiting {st['waiting']}")
            if "hicache_host_capacity" in st:
                lines.append(_tiers_line(st))
        if st and st.get("speculative"):
            sp = st["speculative"]
            lines.append(f"  speculative ({sp['algorithm']}): {100 * sp['accept_rate']:.1f}% of "
                         f"draft tokens accepted, {sp['mean_accept_length']:.2f} tokens per "
                         f"verify pass over {sp['verify_passes']} passes; {sp['state']}")
        return "\n".join(lines)
