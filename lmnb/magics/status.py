"""`%lmnb status`: a live metrics bar and the CacheDashboard widget when `lmnb.widgets` provides
them (counting from the runtime's start, then live), else a summary of `runtime.stats()` as an
HTML table (and plain text)."""

from __future__ import annotations

import html
from typing import Any, Protocol, runtime_checkable

_ROWS = (
    ("cache hit rate", "cache_hit_rate", "{:.1%}"),
    ("recent cache hit rate", "recent_cache_hit_rate", "{:.1%}"),
    ("prompt tokens", "prompt_tokens", "{:,}"),
    ("cached tokens", "cached_tokens", "{:,}"),
    ("image/video tokens cached", ("cached_media_tokens", "media_tokens"), "{:,} of {:,}"),
    ("generated tokens", "generated_tokens", "{:,}"),
    ("jump-forward tokens", "jump_forward_tokens", "{:,}"),
    ("mean time to first token", "mean_first_token_latency", "{:.3f} s"),
    ("forward passes", "forward_passes", "{:,}"),
    ("running / waiting", ("running", "waiting"), "{} / {}"),
    ("free KV tokens", ("free_tokens", "max_total_tokens"), "{:,} of {:,}"),
    ("radix tree", ("tree_nodes", "tree_tokens"), "{:,} nodes, {:,} tokens"),
    ("evictable / locked tokens", ("evictable_tokens", "protected_tokens"), "{:,} / {:,}"),
    ("evicted tokens", "evicted_tokens", "{:,}"),
    ("retractions", "retractions", "{:,}"),
    ("device tier", "hicache_device_tokens", "{:,} tokens"),
    ("host tier", ("hicache_host_tokens", "hicache_host_capacity", "hicache_host_loaded_tokens"),
     "{:,} of {:,} tokens, {:,} hit"),
    ("disk tier", ("hicache_disk_bytes", "hicache_disk_loaded_tokens"),
     "{:,} bytes, {:,} tokens hit"),
)


class StatusSummary:
    def __init__(self, title: str, stats: dict[str, Any]) -> None:
        self.title = title
        self.stats = stats

    def rows(self) -> list[tuple[str, str]]:
        rows = []
        for label, keys, fmt in _ROWS:
            keys = keys if isinstance(keys, tuple) else (keys,)
            if all(self.stats.get(key) is not None for key in keys):
                rows.append((label, fmt.format(*(self.stats[key] for key in keys))))
        return rows

    def _repr_html_(self) -> str:
        body = "".join(f'<tr><td style="text-align:left">{html.escape(label)}</td>'
                       f'<td style="text-align:right">{html.escape(value)}</td></tr>'
                       for label, value in self.rows())
        return (f'<div class="lmnb-status"><b>lmnb</b>: {html.escape(self.title)}'
                f"<table>{body}</table></div>")

    def __repr__(self) -> str:
        width = max(len(label) for label, _ in self.rows())
        lines = [f"lmnb: {self.title}"]
        lines.extend(f"  {label:<{width}}  {value}" for label, value in self.rows())
        return "\n".join(lines)


@runtime_checkable
class LiveView(Protocol):
    """A widget that polls the runtime until told to stop (`lmnb.widgets.PollingWidget`)."""

    def stop_polling(self, status: str) -> None: ...


def status_views(runtime: Any, title: str) -> list[Any]:
    """What `%lmnb status` shows, in order: a live metrics bar and the dashboard (widgets
    installed), else the summary."""
    try:
        from lmnb.widgets import CacheDashboard
        from lmnb.widgets.metrics_bar import MetricsBar
    except ImportError:
        return [StatusSummary(title, runtime.stats())]
    return [MetricsBar(runtime), CacheDashboard(runtime, since_runtime_start=True)]
