"""Running a cell's program: in the foreground (blocking; Ctrl-C aborts it), streaming (a live
view refreshed from the main thread while the cell's code runs on a helper thread), or in the
background (a handle at once, the cell's code still running on its helper thread)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import wraps
from typing import Any

from lmnb.lang.program import Program, ProgramState
from lmnb.magics.abort import abort_and_settle
from lmnb.magics.errors import LMProgramInterrupted
from lmnb.magics.live import LiveView, fork_view
from lmnb.magics.result import ProgramResult

_POLL = 0.02


def _recording(func: Callable[..., Any], holder: list[ProgramState],
               created: threading.Event | None = None) -> Program:
    @wraps(func)
    def entry(s: ProgramState) -> Any:
        holder.append(s)
        if created is not None:
            created.set()
        return func(s)

    return Program(entry)


def run_foreground(func: Callable[..., Any], backend: Any, sampling: dict[str, Any],
                   ) -> ProgramResult:
    holder: list[ProgramState] = []
    try:
        state = _recording(func, holder).run(backend=backend, stream=True, **sampling)
        state.sync()
    except KeyboardInterrupt:
        if holder:
            abort_and_settle(holder[0])
        raise LMProgramInterrupted() from None
    return ProgramResult(state)


def start(func: Callable[..., Any], backend: Any, sampling: dict[str, Any]) -> ProgramResult:
    """Runs the cell's code on a helper thread; returns as soon as its state exists."""
    holder: list[ProgramState] = []
    failure: list[BaseException] = []
    created = threading.Event()
    program = _recording(func, holder, created)

    def body() -> None:
        try:
            program.run(backend=backend, stream=True, **sampling)
        except BaseException as error:  # the program's own errors are kept in its state
            failure.append(error)
        finally:
            created.set()

    thread = threading.Thread(target=body, name="lmnb-cell", daemon=True)
    thread.start()
    try:
        while not created.wait(_POLL):
            pass
    except KeyboardInterrupt:
        created.wait()  # the state is made first thing: abort what it has started
        if holder:
            abort_and_settle(holder[0])
        raise LMProgramInterrupted() from None
    if not holder:
        raise failure[0] if failure else RuntimeError("the program did not start")
    return ProgramResult(holder[0], thread)


def run_streaming(func: Callable[..., Any], backend: Any, sampling: dict[str, Any], *,
                  hz: float) -> ProgramResult:
    result = start(func, backend, sampling)
    view = None
    try:
        view = LiveView(result, hz=hz)
        while not result.done:
            view.refresh()
            time.sleep(_POLL)
        result.state.sync()
    except KeyboardInterrupt:
        abort_and_settle(result.state)
        raise LMProgramInterrupted() from None
    finally:
        if view is not None:
            view.close()
    return ProgramResult(result.state)


def run_background(func: Callable[..., Any], backend: Any, sampling: dict[str, Any], *,
                   live: bool) -> ProgramResult:
    result = start(func, backend, sampling)
    try:
        if live and (widget := fork_view(result.state)) is not None:
            from IPython.display import display

            display(widget)
    except KeyboardInterrupt:
        abort_and_settle(result.state)
        raise LMProgramInterrupted() from None
    return result
