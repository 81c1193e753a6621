"""Live Jupyter widgets (anywidget): program forks, a program's tokens by origin, cache
statistics, the radix tree and the images/videos whose KV the cache reuses (LLaVA).

Each widget polls or observes on daemon threads, updates at most ~20 times a second, has
`refresh()` for an update now, `close()`, and a plain-text `repr` for frontends without widgets.
"""

from __future__ import annotations

from lmnb.widgets.cache_dashboard import CacheDashboard
from lmnb.widgets.fork_view import ForkView
from lmnb.widgets.media_reuse_view import MediaReuseView
from lmnb.widgets.radix_tree_view import RadixTreeView
from lmnb.widgets.token_view import TokenView

__all__ = ["CacheDashboard", "ForkView", "MediaReuseView", "RadixTreeView", "TokenView"]
