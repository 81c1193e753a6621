"""`MetricsBar`: a runtime's metrics bar (`%lmnb status`), polled live: mean time to first
token, output tokens/s between polls, cache-hit and jump-forward shares, forward passes, KV pool
use and GPU memory."""

from __future__ import annotations

import threading
import time
from typing import Any

import anywidget
import traitlets

from lmnb.widgets.esm_helpers import ESM_HELPERS
from lmnb.widgets.metrics import Metrics, metrics_html, metrics_text, runtime_metrics
from lmnb.widgets.poller import PollingWidget
from lmnb.widgets.saved_text import SavedText

_ESM = ESM_HELPERS + r"""
function render({ model, el }) {
  const box = node("div", "lmnb-metricsbar");
  el.append(box);
  const draw = () => {
    box.innerHTML = model.get("html") || "";
    box.dataset.status = model.get("status");
  };
  return redrawOn(model, ["change:html", "change:status"], draw);
}
export default { render };
"""


class MetricsBar(PollingWidget, SavedText, anywidget.AnyWidget):
    """The metrics of `runtime` since it started, re-read every `interval_s` seconds (None:
    only on `refresh()`); tokens/s is measured between two reads."""

    _esm = _ESM
    metrics = traitlets.Dict().tag(sync=True)
    html = traitlets.Unicode("").tag(sync=True)
    status = traitlets.Unicode("live").tag(sync=True)

    def __init__(self, runtime: Any, *, interval_s: float | None = 1.0) -> None:
        super().__init__()
        self._runtime = runtime
        self._lock = threading.Lock()
        self._last: tuple[float, int] | None = None  # (time, output tokens) of the last read
        self.refresh()
        self.start_polling(interval_s)

    def _poll(self) -> bool:
        stats = self.read_runtime(lambda runtime: runtime.stats())
        if stats is None:
            return self._runtime is not None
        now = time.monotonic()
        tokens = stats.get("generated_tokens", 0) + stats.get("jump_forward_tokens", 0)
        with self._lock:
            rate = None
            if self._last is not None and now > self._last[0]:
                rate = (tokens - self._last[1]) / (now - self._last[0])
            self._last = (now, tokens)
            metrics = runtime_metrics(stats, tokens_per_s=rate)
            with self.hold_sync():
                self.metrics = metrics.as_dict()
                self.html = metrics_html(metrics)
        return True

    def refresh(self) -> None:
        """Reads the runtime's stats now."""
        self._poll()
        self.update_saved_text()

    def _repr_mimebundle_(self, **kwargs: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        bundle = super()._repr_mimebundle_(**kwargs)
        data, metadata = bundle if isinstance(bundle, tuple) else (bundle, {})
        return {**(data or {}), "text/html": self.html}, metadata or {}

    def __repr__(self) -> str:
        return (f"MetricsBar ({self.status}): "
                f"{metrics_text(Metrics(**self.metrics)) if self.metrics else 'n/a'}")
