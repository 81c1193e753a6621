"""The program default backend (`lmnb.set_default_backend`; SGLang's `global_config`'s)
and how a `backend=` argument becomes a `Backend`: a `Runtime` is wrapped in a `LocalBackend`."""

from __future__ import annotations

from typing import Any

from lmnb.lang.backends.base import Backend

_default_backend: Backend | None = None


def set_default_backend(backend: Any) -> None:
    """Programs run here unless `run(backend=...)` says otherwise; a `Runtime` is accepted;
    None clears it."""
    global _default_backend
    _default_backend = None if backend is None else as_backend(backend)


def default_backend() -> Backend | None:
    """The default backend (after `%lmnb load`, the kernel's; its `.runtime` is the Runtime)."""
    return _default_backend


def as_backend(backend: Any) -> Backend:
    if backend is None:
        if _default_backend is None:
            raise RuntimeError("no backend: call lmnb.set_default_backend(lmnb.Runtime()) or pass "
                               "backend=... to run()")
        return _default_backend
    if hasattr(backend, "generate") and hasattr(backend, "tokenizer") \
            and not hasattr(backend, "chat_template"):
        from lmnb.lang.backends.local import LocalBackend

        return LocalBackend(backend)
    return backend
