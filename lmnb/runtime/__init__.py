"""The inference engine: scheduler, memory pools, model runner, sampling, prefix cache.

Usable without IPython; never imports `lmnb.lang`, `lmnb.magics` or `lmnb.widgets`.
`Runtime` is imported lazily so that importing this package does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["Runtime"]

if TYPE_CHECKING:
    from lmnb.runtime.launch import Runtime


def __getattr__(name: str) -> Any:
    if name == "Runtime":  # the engine, or a data-parallel runtime (`dp_size`)
        from lmnb.runtime.launch import Runtime

        return Runtime
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
