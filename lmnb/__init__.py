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
    separate_reasoning,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
    video,
)
from lmnb.lang.choices import (
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from lmnb.lang.default_backend import default_backend, set_default_backend
from lmnb.lang.global_config import global_config
from lmnb.lang.program import Program, ProgramState, function

__version__ = "0.1.0"

__all__ = [
    "Engine", "LocalBackend", "OpenAI", "Program", "ProgramState", "Runtime", "RuntimeEndpoint",
    "__version__", "assistant", "assistant_begin", "assistant_end", "default_backend",
    "flush_cache", "function", "gen", "gen_int", "gen_string", "get_server_info", "global_config",
    "greedy_token_selection", "image", "select", "separate_reasoning", "set_default_backend",
    "system", "system_begin", "system_end", "token_length_normalized",
    "unconditional_likelihood_normalized", "user", "user_begin", "user_end", "video",
]

if TYPE_CHECKING:
    from lmnb.lang.backends.endpoint import RuntimeEndpoint
    from lmnb.lang.backends.local import LocalBackend
    from lmnb.lang.backends.openai import OpenAI
    from lmnb.runtime.launch import Runtime
    from lmnb.runtime.launch import Runtime as Engine


def flush_cache(backend: Any = None) -> bool:
    """SGLang's `sgl.flush_cache()`: empties the prefix cache of `backend` (default: the default
    backend); False while requests are running or waiting."""
    from lmnb.lang.backends.base import CacheFlushing
    from lmnb.lang.program import as_backend

    target = as_backend(backend)
    if not isinstance(target, CacheFlushing):
        raise NotImplementedError(f"{type(target).__name__} has no flush_cache()")
    return target.flush_cache()


def get_server_info(backend: Any = None) -> dict[str, Any]:
    """SGLang's `sgl.get_server_info()`: the settings and statistics of `backend`'s runtime
    (default: the default backend's)."""
    from lmnb.lang.backends.base import ServerInfoSource
    from lmnb.lang.program import as_backend

    target = as_backend(backend)
    if not isinstance(target, ServerInfoSource):
        raise NotImplementedError(f"{type(target).__name__} has no get_server_info()")
    return target.get_server_info()


def load_ipython_extension(ipython: Any) -> None:
    """`%load_ext lmnb`: registers `%lmnb` and `%%lmprogram` (options: `%config LMNB`)."""
    from lmnb.magics.extension import load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """`%unload_ext lmnb` (and `%reload_ext lmnb`): closes the kernel's runtime."""
    from lmnb.magics.extension import unload

    unload(ipython)


def __getattr__(name: str) -> Any:
    if name in ("Runtime", "Engine"):  # Engine: SGLang's name for the in-process runtime
        from lmnb.runtime.launch import Runtime

        return Runtime
    if name == "RuntimeEndpoint":
        from lmnb.lang.backends.endpoint import RuntimeEndpoint

        return RuntimeEndpoint
    if name == "LocalBackend":
        from lmnb.lang.backends.local import LocalBackend

        return LocalBackend
    if name == "OpenAI":
        from lmnb.lang.backends.openai import OpenAI

        return OpenAI
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
