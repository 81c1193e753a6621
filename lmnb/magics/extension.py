"""`%load_ext lmnb` / `%unload_ext lmnb` / `%reload_ext lmnb`."""

from __future__ import annotations

from typing import Any

from lmnb.lang import program as program_module
from lmnb.magics.magics import LMNB


def load(shell: Any) -> None:
    magics = LMNB(shell=shell)
    shell.register_magics(magics)
    if program_module.default_backend() is None:  # programs from Python follow the kernel's model
        program_module.set_default_backend(magics.session.backend)


def unload(shell: Any) -> None:
    """Closes the runtime (its scheduler thread ends) and removes the magics and options."""
    manager = shell.magics_manager
    magics = manager.registry.pop(LMNB.__name__, None)
    if magics is None:
        return
    magics.session.close()
    for table in manager.magics.values():
        for name in [n for n, fn in table.items() if getattr(fn, "__self__", None) is magics]:
            del table[name]
    if magics in shell.configurables:
        shell.configurables.remove(magics)
    if program_module.default_backend() is magics.session.backend:
        program_module.set_default_backend(None)
