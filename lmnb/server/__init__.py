"""The kernel's runtime as an HTTP server (OpenAI, SGLang native, Anthropic, Ollama APIs):
`create_app(runtime)` for any ASGI server, `ServerHandle.start(runtime)` to serve it from a
background thread, `python -m lmnb serve` outside Jupyter. Needs the `server` extra."""

from lmnb.server.app import create_app
from lmnb.server.serving import ServerHandle, serve

__all__ = ["ServerHandle", "create_app", "serve"]
