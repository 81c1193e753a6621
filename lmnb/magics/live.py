"""The live view of a streaming cell: the ForkView widget when `lmnb.widgets` provides it, else a
display handle whose text is refreshed at most `hz` times a second. Refreshes are called from the
kernel's main thread; engine and program threads never write output."""

from __future__ import annotations

import time
from typing import Any


def fork_view(state: Any) -> Any | None:
    try:
        from lmnb.widgets import ForkView
    except ImportError:
        return None
    return ForkView(state)


class _Blank:
    def _repr_html_(self) -> str:
        return ""

    def __repr__(self) -> str:
        return ""


class LiveView:
    def __init__(self, result: Any, *, hz: float) -> None:
        from IPython.display import display

        self.result = result
        self.interval = 1.0 / hz
        self.widget = fork_view(result.state)
        self.handle = None
        self._last = time.monotonic()
        if self.widget is not None:
            display(self.widget)
        else:
            self.handle = display(result, display_id=True)

    def refresh(self) -> None:
        now = time.monotonic()
        if self.handle is not None and now - self._last >= self.interval:
            self._last = now
            self.handle.update(self.result)

    def close(self) -> None:
        """The widget stays, refreshed once more from the main thread so that its final state
        belongs to the cell's output (nbclient keeps only a cell's own comm messages); the text
        view gives way to the cell's result. The widget's refresh also re-displays it, so a
        saved notebook's plain-text fallback is its final state, not "running"."""
        if self.widget is not None:
            self.widget.refresh()
        if self.handle is not None:
            self.handle.update(_Blank())
