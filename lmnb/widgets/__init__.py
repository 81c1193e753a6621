"""Live Jupyter widgets (anywidget): program forks, a program's tokens by origin, cache
statistics, the radix tree and the images/videos whose KV the cache reuses (LLaVA).

Each widget polls or observes on daemon threads, updates at most ~20 times a second, has
`refresh()` for an update now, `close()`, and a plain-text `repr` for frontends without widgets.
The widgets are imported on first use, so that the modules without a widget library
(`token_view_model`, `metrics`, `throttle`) import where anywidget is not installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmnb.widgets.cache_dashboard import CacheDashboard
    from lmnb.widgets.fork_view import ForkView
    from lmnb.widgets.media_reuse_view import MediaReuseView
    from lmnb.widgets.radix_tree_view import RadixTreeView
    from lmnb.widgets.token_view import TokenView

_MODULES = {"CacheDashboard": "cache_dashboard", "ForkView": "fork_view",
            "MediaReuseView": "media_reuse_view", "RadixTreeView": "radix_tree_view",
            "TokenView": "token_view"}

__all__ = ["CacheDashboard", "ForkView", "MediaReuseView", "RadixTreeView", "TokenView"]


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
