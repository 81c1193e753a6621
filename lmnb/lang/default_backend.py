"""The program default backend (`lmnb.set_default_backend`; SGLang's `global_config`'s)
and how a `backend=` argument becomes a `Backend`: a `Runtime` is wrapped in a `LocalBackend`, a
`BackendSource` (the kernel's default) gives its current backend."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from lmnb.lang.backends.base import Backend


@runtime_checkable
class BackendSource(Protocol):
    """Stands for whichever backend is current when a run starts (the kernel's: that of the
    runtime `%lmnb load` loaded last, loading the configured model on first use)."""

    def current_backend(self) -> Backend: ...


_default_backend: Backend | BackendSource | None = None


def set_default_backend(backend: Any) -> None:
    """Programs run here unless `run(backend=...)` says otherwise; a `Runtime` is accepted;
    None clears it."""
    global _default_backend
    _default_backend = None if backend is None else _wrapped(backend)


def default_backend() -> Backend | BackendSource | None:
    """The default backend (after `%lmnb load`, the kernel's; its `.runtime` is the Runtime)."""
    return _default_backend


def as_backend(backend: Any) -> Backend:
    """The backend a run (or an SGLang backend call) uses: `backend`, else the default."""
    if backend is None:
        if _default_backend is None:
            raise RuntimeError("no backend: call lmnb.set_default_backend(lmnb.Runtime()) or pass "
                               "backend=... to run()")
        backend = _default_backend
    backend = _wrapped(backend)
    return backend.current_backend() if isinstance(backend, BackendSource) else backend


def _wrapped(backend: Any) -> Backend | BackendSource:
    """`backend`, or a `LocalBackend` over it when it is a runtime (an `EngineSurface`)."""
    if isinstance(backend, (Backend, BackendSource)):
        return backend
    from lmnb.runtime.surface import EngineSurface  # imports torch: only for what may be one

    if isinstance(backend, EngineSurface):
        from lmnb.lang.backends.local import LocalBackend

        return LocalBackend(backend)
    return backend
