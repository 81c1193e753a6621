"""`lmnb.Runtime`, the public constructor of a runtime: the in-process engine
(`engine.Runtime`), or with `dp_size=N` > 1 a `DataParallelRuntime` of N engines behind a
cache-aware router. It sits above both, so the engine never imports the data-parallel runtime
(whose Ray replicas build engines)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmnb.runtime.distributed.dp_runtime import DataParallelRuntime
from lmnb.runtime.engine import Runtime as Engine


class Runtime(Engine):
    __doc__ = Engine.__doc__

    def __new__(cls, model_path: str | Path | None = None, **options: Any) -> Any:
        """`Runtime(path, dp_size=N)` with N > 1 is a `DataParallelRuntime`: N replicas behind
        a cache-aware router, with the same generate/stats/close surface."""
        if cls is Runtime and options.get("dp_size", 1) not in (1, None):
            return DataParallelRuntime(model_path, **options)
        return super().__new__(cls)
