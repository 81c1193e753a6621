"""An IPython shell with the lmnb extension loaded, for tests of the magics."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config


@contextmanager
def lmnb_shell(*config: str) -> Iterator[InteractiveShell]:
    """A fresh shell (history in memory) with lmnb loaded, progress bars off and each `%config`
    line of `config` run; unloaded and cleared after."""
    settings = Config()
    settings.HistoryManager.hist_file = ":memory:"
    shell = InteractiveShell.instance(config=settings)
    try:
        shell.run_line_magic("load_ext", "lmnb")
        for line in ("LMNB.progress = False", *config):
            shell.run_line_magic("config", line)
        yield shell
    finally:
        if "lmnb" in shell.extension_manager.loaded:
            shell.run_line_magic("unload_ext", "lmnb")
        InteractiveShell.clear_instance()
