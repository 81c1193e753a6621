"""lmnb: SGLang-style structured LLM programs, with a persistent runtime inside a Jupyter kernel.

`import lmnb` stays light: the engine (and torch) is imported on first use of `lmnb.Runtime`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmnb.lang.api import (
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    gen_int,
    gen_string,
    image,
    select,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
    video,
)
from lmnb.lang.program import (
    Program,
    ProgramState,
    default_backend,
    function,
    set_default_backend,
)

__version__ = "0.1.0"

__all__ = [
    "LocalBackend", "OpenAI", "Program", "ProgramState", "Runtime", "__version__", "assistant",
    "assistant_begin", "assistant_end", "default_backend", "function", "gen", "gen_int",
    "gen_string", "image", "select", "set_default_backend", "system", "system_begin",
    "system_end", "user", "user_begin", "user_end", "video",
]

if TYPE_CHECKING:
    from lmnb.lang.backends.local import LocalBackend
    from lmnb.lang.backends.openai import OpenAI
    from lmnb.runtime.engine import Runtime


def load_ipython_extension(ipython: Any) -> None:
    """`%load_ext lmnb`: registers `%lmnb` and `%%lmprogram` (options: `%config LMNB`)."""
    from lmnb.magics.extension import load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """`%unload_ext lmnb` (and `%reload_ext lmnb`): closes the kernel's runtime."""
    from lmnb.magics.extension import unload

    unload(ipython)


def __getattr__(name: str) -> Any:
    if name == "Runtime":
        from lmnb.runtime.engine import Runtime

        return Runtime
    if name == "LocalBackend":
        from lmnb.lang.backends.local import LocalBackend

        return LocalBackend
    if name == "OpenAI":
        from lmnb.lang.backends.openai import OpenAI

        return OpenAI
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
