"""`ProgramError`, and `located`: an error raised while a gen or select runs carries its
program line."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from lmnb.lang.ir import SourceLocation


class ProgramError(RuntimeError):
    """An error raised inside a program, re-raised where its result is read."""


@contextmanager
def located(where: SourceLocation | None) -> Iterator[None]:
    """An error raised inside records `where` (the program line of the gen or select that was
    running) as `error.lmnb_where`, unless it has one already: the loop's traceback does
    not reach the program's code."""
    try:
        yield
    except BaseException as error:
        if where is not None and getattr(error, "lmnb_where", None) is None:
            try:
                error.lmnb_where = where  # type: ignore[attr-defined]
            except AttributeError:  # an exception type without a __dict__
                pass
        raise
