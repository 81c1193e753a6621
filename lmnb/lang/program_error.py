"""`ProgramError`, and `located` / `location_of`: an error raised while a gen or select runs
carries its program line."""

from __future__ import annotations

from types import TracebackType
from typing import Any

from lmnb.lang.ir import SourceLocation


class ProgramError(RuntimeError):
    """An error raised inside a program, re-raised where its result is read."""


def runtime_abort_message(meta_info: Any) -> str | None:
    """Why a runtime aborted a request, from its `meta_info` (finish reason `{"type": "abort",
    "message": ...}`: out of KV cache, a failed step, a closed runtime), else None."""
    reason = meta_info.get("finish_reason") if isinstance(meta_info, dict) else None
    if isinstance(reason, dict) and reason.get("type") == "abort":
        return str(reason.get("message") or "no reason given")
    return None


class located:
    """`with located(where):` an error raised inside records `where` (the program line of the
    gen or select that was running) as `error.lmnb_where`, unless it has one already: the
    loop's traceback does not reach the program's code. (A class: entered once per gen.)"""

    __slots__ = ("where",)

    def __init__(self, where: SourceLocation | None) -> None:
        self.where = where

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if error is not None and self.where is not None and location_of(error) is None:
            try:
                error.lmnb_where = self.where  # type: ignore[attr-defined]
            except AttributeError:  # an exception type without a __dict__
                pass


def location_of(error: BaseException) -> SourceLocation | None:
    """The program line `located` recorded on `error` (any exception type: an attribute it
    carries, read here alone), else None."""
    where = getattr(error, "lmnb_where", None)
    return where if isinstance(where, tuple) and len(where) == 2 else None
