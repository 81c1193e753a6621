"""The plain-text fallback of a widget in a saved notebook (what nbconvert and GitHub show).

A frontend stores a widget output's text/plain once, when the widget is displayed; a live widget
has changed since. `SavedText` displays the widget under a display id and re-displays it in place
when the widget refreshes from the kernel's main thread (output from other threads would land in
whichever cell runs then), so the saved text is the latest state."""

from __future__ import annotations

import threading
from typing import Any


def _bundle(widget: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    bundle = widget._repr_mimebundle_()
    if isinstance(bundle, tuple):
        data, metadata = bundle
        return data, metadata or {}
    return bundle or {}, {}


class SavedText:
    """Mixin for anywidgets with a plain-text `__repr__`; put it before the widget base."""

    def _ipython_display_(self) -> None:
        from IPython.display import display

        data, metadata = _bundle(self)
        handle = display(data, metadata=metadata, raw=True, display_id=True)
        if handle is not None:
            self.__dict__.setdefault("_saved_text_handles", []).append(handle)

    def update_saved_text(self) -> None:
        """Re-displays the widget where it was displayed, with its current text; a no-op off
        the main thread and for a widget never displayed."""
        handles = self.__dict__.get("_saved_text_handles")
        if not handles or threading.current_thread() is not threading.main_thread():
            return
        data, metadata = _bundle(self)
        for handle in handles:
            handle.update(data, metadata=metadata, raw=True)
