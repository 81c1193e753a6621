"""Loading a Runtime in the foreground with a progress bar (a widget in notebooks, gone from the
saved notebook once loaded).

The load itself runs on the kernel's main thread: on CPU, a Runtime whose weights were the first
torch work of a short-lived thread decodes ~25x slower (the OpenMP pool stays bound to the dead
thread). A helper thread only keeps the bar's elapsed time moving while a stage runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_TICK_S = 0.5
EMBEDDED_NAME = "SmolLM2-135M-Instruct (embedded)"


@contextmanager
def _ticking(bar: Any) -> Iterator[None]:
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(_TICK_S):
            bar.refresh()

    thread = threading.Thread(target=tick, name="lmnb-load-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def load_runtime(model: str | None, *, progress: bool = True,
                 on_found: Callable[[], None] | None = None, **options: Any) -> Any:
    """`lmnb.Runtime(model, **options)`; None is the embedded SmolLM2-135M-Instruct (converted
    from GGUF and cached on first use). `on_found` runs once the model's files are found, before
    its weights load (e.g. to close the runtime it replaces)."""
    from lmnb.lang.progress import progress_bar
    from lmnb.runtime.launch import Runtime
    from lmnb.runtime.models.loader import resolve_model_dir

    label = EMBEDDED_NAME if model is None else Path(model).name
    with progress_bar(total=2, desc=f"lmnb: finding {label}", disable=not progress, leave=False,
                      bar_format="{desc} {bar} {n_fmt}/{total_fmt} [{elapsed}]") as bar:
        with _ticking(bar):
            model_dir = resolve_model_dir(model)
            bar.update(1)
            if on_found is not None:
                on_found()
            bar.set_description(f"lmnb: loading {label}")
            runtime = Runtime(model_dir, **options)
            bar.update(1)
    return runtime


def describe(runtime: Any) -> str:
    dtype = str(runtime.dtype).removeprefix("torch.")
    return (f"{runtime.model_dir.name} on {runtime.device} ({dtype}), "
            f"{runtime.max_total_tokens} KV tokens, context {runtime.context_len}")
