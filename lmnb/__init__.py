"""lmnb: SGLang-style structured LLM programs, with a persistent runtime inside a Jupyter kernel.

`import lmnb` stays light: the engine (and torch) is imported on first use of `lmnb.Runtime`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["Runtime", "__version__"]

if TYPE_CHECKING:
    from lmnb.runtime.engine import Runtime


def __getattr__(name: str) -> Any:
    if name == "Runtime":
        from lmnb.runtime.engine import Runtime

        return Runtime
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
