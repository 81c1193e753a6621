"""`ServerHandle`: uvicorn serving `create_app(runtime)` from a daemon thread with its own
event loop, on a socket bound before the thread starts (port 0 picks a free port)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Sequence

import uvicorn

from lmnb.server.app import ALL_ORIGINS, create_app
from lmnb.server.limits import DEFAULT_MAX_REQUEST_BYTES
from lmnb.server.streams import ServedRuntime


class ServerHandle:
    """A running server; `url`, `stop()`. The runtime is not owned: stopping the server leaves
    it running."""

    def __init__(self, server: uvicorn.Server, sock: socket.socket, thread: threading.Thread,
                 runtime: ServedRuntime) -> None:
        self._server, self._socket, self._thread = server, sock, thread
        self.runtime = runtime
        self.host, self.port = sock.getsockname()[:2]

    @classmethod
    def start(cls, runtime: ServedRuntime, *, host: str = "127.0.0.1", port: int = 0,
              api_key: str | None = None, served_model_name: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              allowed_origins: Sequence[str] = ALL_ORIGINS,
              log_level: str = "warning", startup_timeout: float = 30.0) -> ServerHandle:
        app = create_app(runtime, api_key=api_key, served_model_name=served_model_name,
                         max_request_bytes=max_request_bytes, allowed_origins=allowed_origins)
        # log_config=None: uvicorn leaves the process's (the kernel's) logging setup alone
        config = uvicorn.Config(app, log_level=log_level, log_config=None, access_log=False,
                                loop="asyncio",
                                http="h11", lifespan="off", timeout_graceful_shutdown=2)
        server = uvicorn.Server(config)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            raise
        thread = threading.Thread(target=_run, args=(server, sock), daemon=True,
                                  name=f"lmnb-server-{sock.getsockname()[1]}")
        handle = cls(server, sock, thread, runtime)
        thread.start()
        deadline = time.monotonic() + startup_timeout
        while not server.started:  # bounded wait for uvicorn's startup (listen + lifespan)
            if not thread.is_alive() or time.monotonic() > deadline:
                handle.stop()
                raise RuntimeError("the server did not start")
            thread.join(0.01)
        return handle

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Stops accepting, gives open streams a moment, then closes them (their requests are
        aborted as on a client disconnect)."""
        self._server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(timeout)
        self._socket.close()

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ServerHandle({self.url}, {'running' if self.running else 'stopped'})"


def _run(server: uvicorn.Server, sock: socket.socket) -> None:
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(server.serve(sockets=[sock]))
    finally:
        try:  # as asyncio.run ends: open responses are cancelled and run their cleanup (a
            # stream's close aborts its requests), async generators are finalized
            tasks = [task for task in asyncio.all_tasks(loop) if not task.done()]
            for task in tasks:
                task.cancel()
            if tasks:  # (gather of nothing asks for this thread's current loop: there is none)
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


def serve(runtime: ServedRuntime, *, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, served_model_name: str | None = None,
          max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
          allowed_origins: Sequence[str] = ALL_ORIGINS, log_level: str = "info") -> None:
    """Serves `runtime` in the foreground until interrupted (`python -m lmnb serve`)."""
    app = create_app(runtime, api_key=api_key, served_model_name=served_model_name,
                     max_request_bytes=max_request_bytes, allowed_origins=allowed_origins)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
