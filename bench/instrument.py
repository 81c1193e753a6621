"""Timing the runtime's own functions from a benchmark: a class's method (or a module's function)
replaced by a wrapper that stamps each call and hands it to a recorder, and put back after.

Only attributes of classes and modules are replaced, never an instance's: every runtime's calls
are seen the same way, and no bench reaches into a `Runtime`'s private state.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

Owner = type | ModuleType


@dataclass(frozen=True, slots=True)
class Call:
    """One call of a wrapped function: `Owner.name`, `time.perf_counter()` at its entry and exit,
    its arguments (a method's `self` first) and its result (None when it raised)."""

    label: str
    start: float
    end: float
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    result: Any

    @property
    def seconds(self) -> float:
        return self.end - self.start


class Patches:
    """Functions of classes and modules replaced for a measurement; `undo()` (or leaving the
    `with` block) puts every one back, the last replaced first."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def replace(self, owner: Owner, name: str, replacement: Callable[..., Any]) -> None:
        original = vars(owner)[name]  # defined there, not inherited: restored as it was
        setattr(owner, name, replacement)
        self._undo.append(lambda: setattr(owner, name, original))

    def wrap(self, owner: Owner, name: str, record: Callable[[Call], None], *,
             before: Callable[[], None] | None = None) -> None:
        """Replaces `owner.name` by a wrapper that calls `before()`, then the original, and hands
        `record` the `Call` (also when the original raised). A staticmethod stays one."""
        original = vars(owner)[name]
        static = isinstance(original, staticmethod)
        function = original.__func__ if static else original
        label = f"{owner.__name__.rsplit('.', 1)[-1]}.{name}"

        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if before is not None:
                before()
            result = None
            start = time.perf_counter()
            try:
                result = function(*args, **kwargs)
                return result
            finally:
                record(Call(label, start, time.perf_counter(), args, kwargs, result))

        self.replace(owner, name, staticmethod(timed) if static else timed)

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()

    def __enter__(self) -> Patches:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.undo()
