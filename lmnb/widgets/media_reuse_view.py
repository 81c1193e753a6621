"""`MediaReuseView`: the images and videos a LLaVA `Runtime` has seen, with their content hash,
their span of tokens, how many requests used them and found them cached, and whether their KV is
resident in the radix cache now or was evicted, updating live while programs run."""

from __future__ import annotations

import base64
import threading
from typing import Any, Protocol, runtime_checkable

import anywidget
import traitlets

from lmnb.widgets.esm_helpers import ESM_HELPERS
from lmnb.widgets.poller import PolledRuntime, PollingWidget
from lmnb.widgets.saved_text import SavedText

_ESM = ESM_HELPERS + r"""
const num = (x) => (x ?? 0).toLocaleString("en-US");

function card(item) {
  const c = node("div", "lmnb-media-card");
  c.dataset.state = item.resident ? "resident" : "evicted";
  c.dataset.change = item.change || "";
  const pic = node("div", "lmnb-media-thumb");
  if (item.thumbnail) {
    const img = node("img");
    img.src = item.thumbnail;
    img.alt = `${item.kind} ${item.hash}`;
    pic.append(img);
  } else {
    pic.append(node("span", "lmnb-media-none", item.kind));
  }
  const head = node("div", "lmnb-media-head");
  head.append(node("span", "lmnb-media-kind", item.kind),
    node("code", "lmnb-media-hash", item.short_hash));
  const size = item.size ? `${item.size[1]}\u00d7${item.size[0]} px \u00b7 ` : "";
  const tokens = node("div", "lmnb-media-line", `${size}${num(item.num_tokens)} tokens`);
  const hits = node("div", "lmnb-media-line",
    `${item.hits} of ${item.requests} requests hit`);
  const state = node("div", "lmnb-media-state", item.resident ? "resident" : "evicted");
  c.title = `hash ${item.hash}\n${item.kind}, ${item.num_tokens} tokens\n` +
    `${item.requests} requests, ${item.hits} found the whole span cached\n` +
    (item.resident ? "its KV is in the radix cache" : "its KV was evicted (or never kept)");
  c.append(pic, head, tokens, hits, state);
  return c;
}

function render({ model, el }) {
  const box = node("div", "lmnb-media");
  const info = node("div", "lmnb-media-info");
  const grid = node("div", "lmnb-media-grid");
  box.append(info, grid);
  el.append(box);
  const draw = () => {
    const s = model.get("summary") || {};
    const hidden = s.hidden ? ` (${s.hidden} older not shown)` : "";
    info.textContent = `${model.get("status")} \u00b7 ${s.media ?? 0} media, ` +
      `${s.resident ?? 0} resident, ${s.evicted ?? 0} evicted \u00b7 media tokens served ` +
      `from cache: ${num(s.cached_media_tokens)} of ${num(s.media_tokens)} ` +
      `(${pct(s.media_hit_rate)})${hidden}`;
    box.dataset.status = model.get("status");
    grid.replaceChildren(...(model.get("items") || []).map(card));
  };
  const names = ["change:items", "change:summary", "change:status"];
  return redrawOn(model, names, draw);
}

export default { render };
"""

_CSS = r"""
.lmnb-media { font-family: var(--jp-ui-font-family, sans-serif); font-size: 12px;
  color: var(--jp-ui-font-color1, #222); }
.lmnb-media .lmnb-media-info { font-size: 11px; color: var(--jp-ui-font-color2, #666);
  margin-bottom: 4px; }
.lmnb-media .lmnb-media-grid { display: flex; flex-wrap: wrap; gap: 8px; max-height: 520px;
  overflow: auto; }
.lmnb-media .lmnb-media-card { width: 124px; border: 2px solid #60a5fa; border-radius: 5px;
  padding: 4px; background: var(--jp-layout-color1, #fff); }
.lmnb-media .lmnb-media-card[data-state="evicted"] { border: 2px dashed #dc2626; opacity: 0.6; }
.lmnb-media .lmnb-media-card[data-change="new"] { box-shadow: 0 0 0 2px #86efac; }
.lmnb-media .lmnb-media-card[data-change="hit"] { box-shadow: 0 0 0 2px #2563eb; }
.lmnb-media .lmnb-media-thumb { height: 96px; display: flex; align-items: center;
  justify-content: center; background: #f3f4f6; }
.lmnb-media .lmnb-media-thumb img { max-width: 112px; max-height: 96px; }
.lmnb-media .lmnb-media-none { color: #888; }
.lmnb-media .lmnb-media-head { display: flex; gap: 4px; align-items: baseline; margin-top: 2px; }
.lmnb-media .lmnb-media-kind { font-weight: 600; }
.lmnb-media .lmnb-media-hash { font-size: 10px; color: #555; }
.lmnb-media .lmnb-media-line { font-size: 11px; }
.lmnb-media .lmnb-media-state { font-size: 11px; font-weight: 600; color: #2563eb; }
.lmnb-media .lmnb-media-card[data-state="evicted"] .lmnb-media-state { color: #dc2626; }
"""

_TRACKED = ("num_tokens", "requests", "hits", "resident")  # a change here redraws


def _data_url(png: bytes | None) -> str | None:
    return None if not png else "data:image/png;base64," + base64.b64encode(png).decode()


@runtime_checkable
class MediaRuntime(PolledRuntime, Protocol):
    """What `MediaReuseView` reads of a LLaVA `Runtime`."""

    def media_snapshot(self) -> list[dict[str, Any]]: ...

    def stats(self) -> dict[str, Any]: ...


class MediaReuseView(SavedText, PollingWidget, anywidget.AnyWidget):
    """The media of a LLaVA `Runtime` (`Runtime.media_snapshot()`, most recent first) as
    thumbnails with their hash, tokens, requests and hits, and whether their KV span is resident
    in the radix cache, polled on a daemon thread every `interval_s` (None: only on
    `refresh()`). Media that changed since the previous redraw are marked `new` (first seen) or
    `hit` (a request found it cached).

    Traits: `items` ([{hash, short_hash, kind, num_tokens, requests, hits, resident, size,
    thumbnail (a data: URL or None), change}]), `summary` ({media, resident, evicted, hidden,
    media_tokens, cached_media_tokens, media_hit_rate, refreshes}), `status`.
    """

    _esm = _ESM
    _css = _CSS
    items = traitlets.List(traitlets.Dict()).tag(sync=True)
    summary = traitlets.Dict().tag(sync=True)
    status = traitlets.Unicode("live").tag(sync=True)

    def __init__(self, runtime: object, *, interval_s: float | None = 0.25,
                 max_items: int = 64) -> None:
        super().__init__()
        if not isinstance(runtime, MediaRuntime):
            raise TypeError(f"{type(runtime).__name__} has no media_snapshot(): MediaReuseView "
                            f"needs an lmnb Runtime")
        self._runtime: MediaRuntime | None = runtime
        self._lock = threading.Lock()
        self._max_items = max_items
        self._previous: dict[str, dict[str, Any]] | None = None
        self._counts: tuple[int, int] | None = None
        self._thumbnails: dict[str, str | None] = {}
        self._refreshes = 0
        self.refresh()
        self.start_polling(interval_s)

    def refresh(self) -> bool:
        """Reads the runtime's media and redraws them if anything changed; False once the
        runtime is gone."""
        alive = self._poll()
        self.update_saved_text()
        return alive

    def _poll(self) -> bool:
        with self._lock:
            read = self.read_runtime(lambda runtime: (runtime.media_snapshot(), runtime.stats()))
            if read is None:
                return self._runtime is not None
            rows, stats = read
            counts = (int(stats.get("media_tokens", 0)), int(stats.get("cached_media_tokens", 0)))
            current = {row["hash"]: row for row in rows}
            if (self._previous is not None and counts == self._counts
                    and list(current) == list(self._previous)
                    and all(current[h][k] == self._previous[h][k]
                            for h in current for k in _TRACKED)):
                return True
            self._draw(rows, counts)
            self._previous, self._counts = current, counts
            return True

    def _change(self, row: dict[str, Any]) -> str:
        if self._previous is None:
            return ""
        before = self._previous.get(row["hash"])
        if before is None:
            return "new"
        return "hit" if row["hits"] > before["hits"] else ""

    def _thumbnail(self, row: dict[str, Any]) -> str | None:
        key = row["hash"]
        if key not in self._thumbnails:
            self._thumbnails[key] = _data_url(row.get("thumbnail"))
        return self._thumbnails[key]

    def _draw(self, rows: list[dict[str, Any]], counts: tuple[int, int]) -> None:
        shown = rows[:self._max_items]
        items = [{"hash": str(row["hash"]), "short_hash": str(row["hash"])[:8],
                  "kind": row["kind"], "num_tokens": int(row["num_tokens"]),
                  "requests": int(row["requests"]), "hits": int(row["hits"]),
                  "resident": bool(row["resident"]),
                  "size": list(row["size"]) if row.get("size") else None,
                  "thumbnail": self._thumbnail(row), "change": self._change(row)}
                 for row in shown]
        live = {row["hash"] for row in rows}
        self._thumbnails = {k: v for k, v in self._thumbnails.items() if k in live}
        self._refreshes += 1
        media_tokens, cached = counts
        resident = sum(bool(row["resident"]) for row in rows)
        with self.hold_sync():
            self.items = items
            self.summary = {"media": len(rows), "resident": resident,
                            "evicted": len(rows) - resident, "hidden": len(rows) - len(shown),
                            "media_tokens": media_tokens, "cached_media_tokens": cached,
                            "media_hit_rate": cached / media_tokens if media_tokens else None,
                            "refreshes": self._refreshes}

    # ---- text ------------------------------------------------------------------------------
    def __repr__(self) -> str:
        s = self.summary
        rate = s.get("media_hit_rate")
        rate_text = f"{100 * rate:.1f}%" if rate is not None else "n/a"
        lines = [f"MediaReuseView ({self.status}): {s.get('media', 0)} media, "
                 f"{s.get('resident', 0)} resident, {s.get('evicted', 0)} evicted; media tokens "
                 f"served from cache: {s.get('cached_media_tokens', 0):,} of "
                 f"{s.get('media_tokens', 0):,} ({rate_text})"]
        for item in self.items[:20]:
            size = f"{item['size'][1]}x{item['size'][0]} px, " if item["size"] else ""
            lines.append(f"  {item['kind']} {item['short_hash']}  {size}{item['num_tokens']} "
                         f"tokens; {item['hits']} of {item['requests']} requests hit; "
                         f"{'resident' if item['resident'] else 'evicted'}")
        more = len(self.items) - 20 + s.get("hidden", 0)
        if more > 0:
            lines.append(f"  … {more} more")
        return "\n".join(lines)
