"""The kernel's one Runtime: loaded by `%lmnb load` (or the embedded default on first use), closed
by `%lmnb close` and when the extension unloads."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from lmnb.magics.loading import load_runtime


class KernelSession:
    def __init__(self, defaults: Callable[[], dict[str, Any]]) -> None:
        self._defaults = defaults  # the magics' current %config options for a lazy load
        self._lock = threading.RLock()
        self.runtime: Any = None
        self._local: Any = None
        self.server: Any = None  # lmnb.server.ServerHandle over `runtime`, while serving
        self.backend = KernelBackend(self)

    def load(self, model: str | None, *, progress: bool = True, **options: Any) -> Any:
        """Loads a model in place of the current one, which is closed once the new model's files
        are found (a mistyped path leaves it running)."""
        from lmnb.lang.backends.local import LocalBackend

        with self._lock:
            runtime = load_runtime(model, progress=progress, on_found=self.close, **options)
            self.runtime, self._local = runtime, LocalBackend(runtime)
            return runtime

    def local_backend(self) -> Any:
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
    """The default backend while the extension is loaded: whatever runtime the kernel has now,
    so that named programs run from Python (`qa.run(...)`) follow `%lmnb load`."""

    is_chat_model = False  # as the LocalBackend it stands for
    reports_token_texts = False

    def __init__(self, session: KernelSession) -> None:
        self.session = session

    @property
    def runtime(self) -> Any:
        """The kernel's Runtime (loading the configured model on first use)."""
        return self.session.local_backend().runtime

    @property
    def chat_template(self) -> Any:
        return self.session.local_backend().chat_template

    def generate(self, prompt: str, params: Any, **kwargs: Any) -> Any:
        return self.session.local_backend().generate(prompt, params, **kwargs)

    def select(self, prompt: str, choices: tuple[str, ...], method: str,
               **kwargs: Any) -> tuple[str, dict]:
        return self.session.local_backend().select(prompt, choices, method, **kwargs)

    def cache_prefix(self, prompt: str, **kwargs: Any) -> None:
        self.session.local_backend().cache_prefix(prompt, **kwargs)

    def prepare_media(self, kind: str, source: Any, **kwargs: Any) -> Any:
        return self.session.local_backend().prepare_media(kind, source, **kwargs)
