"""`ProgramError`, and `located`: an error raised while a gen or select runs carries its
program line."""

from __future__ import annotations

from types import TracebackType

from lmnb.lang.ir import SourceLocation


class ProgramError(RuntimeError):
    """An error raised inside a program, re-raised where its result is read."""


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
        if (error is not None and self.where is not None
                and getattr(error, "lmnb_where", None) is None):
            try:
                error.lmnb_where = self.where  # type: ignore[attr-defined]
            except AttributeError:  # an exception type without a __dict__
                pass
