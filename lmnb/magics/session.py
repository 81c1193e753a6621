"""The kernel's one Runtime: loaded by `%lmnb load` (or the embedded default on first use), closed
by `%lmnb close` and when the extension unloads."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from lmnb.lang.backends.local import LocalBackend
from lmnb.magics.loading import load_runtime


class KernelSession:
    def __init__(self, defaults: Callable[[], dict[str, Any]]) -> None:
        self._defaults = defaults  # the magics' current %config options for a lazy load
        self._lock = threading.RLock()
        self.runtime: Any = None
        self._local: LocalBackend | None = None
        self.server: Any = None  # lmnb.server.ServerHandle over `runtime`, while serving
        self.backend = KernelBackend(self)

    def load(self, model: str | None, *, progress: bool = True, **options: Any) -> Any:
        """Loads a model in place of the current one, which is closed once the new model's files
        are found (a mistyped path leaves it running)."""
        with self._lock:
            runtime = load_runtime(model, progress=progress, on_found=self.close, **options)
            self.runtime, self._local = runtime, LocalBackend(runtime)
            return runtime

    def local_backend(self) -> LocalBackend:
        """The current runtime's backend, loading the configured default model if none is."""
        with self._lock:
            if self.runtime is None:
                options = dict(self._defaults())
                self.load(options.pop("model"), **options)
            return self._local

    def serve(self, **options: Any) -> Any:
        """Serves the current runtime (loading the default model if none is) over HTTP, in
        place of a server already running."""
        from lmnb.server import ServerHandle

        with self._lock:
            runtime = self.local_backend().runtime
            self.stop_server()
            self.server = ServerHandle.start(runtime, **options)
            return self.server

    def stop_server(self) -> bool:
        with self._lock:
            server, self.server = self.server, None
        if server is None:
            return False
        server.stop()
        return True

    def close(self) -> bool:
        self.stop_server()  # a server never outlives its runtime
        with self._lock:
            runtime, self.runtime, self._local = self.runtime, None, None
        if runtime is None:
            return False
        runtime.close()
        return True


class KernelBackend:
    """The default backend while the extension is loaded (a `BackendSource`): each run gets the
    `LocalBackend` of the runtime the kernel has when it starts, so that named programs run from
    Python (`qa.run(...)`, `qa.pin()`, `lmnb.flush_cache()`) follow `%lmnb load`."""

    def __init__(self, session: KernelSession) -> None:
        self.session = session

    @property
    def runtime(self) -> Any:
        """The kernel's Runtime (loading the configured model on first use)."""
        return self.session.local_backend().runtime

    def current_backend(self) -> LocalBackend:
        return self.session.local_backend()
