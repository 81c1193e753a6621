"""Short, nbval-visible errors for `%%lmprogram` cells: the message and the offending cell line."""

from __future__ import annotations

import linecache

from lmnb.magics.cell import CellSource


def _root_cause(error: BaseException) -> BaseException:
    """The error the user made, not the interpreter's wrapper that re-raised it."""
    from lmnb.lang.interpreter import ProgramError

    while isinstance(error, ProgramError) and error.__cause__ is not None:
        error = error.__cause__
    return error


def _causes(error: BaseException, limit: int = 3) -> list[BaseException]:
    """The errors `error` was raised from (its `__cause__` chain), wrappers left out."""
    from lmnb.lang.interpreter import ProgramError

    causes: list[BaseException] = []
    cause = error.__cause__
    while cause is not None and len(causes) < limit and cause is not error:
        if not isinstance(cause, ProgramError):
            causes.append(cause)
        cause = cause.__cause__
    return causes


def _cell_lineno(error: BaseException, filename: str) -> int | None:
    if isinstance(error, SyntaxError) and error.filename == filename:
        return error.lineno
    lineno = None
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename:
            lineno = tb.tb_lineno
        tb = tb.tb_next
    return lineno


def _gen_line(error: BaseException) -> tuple[str, int] | None:
    """(file, line) of the gen or select whose run raised `error` (the interpreter records it:
    the worker thread's traceback does not reach the program's code)."""
    from lmnb.lang.program_error import location_of

    return location_of(error)


class LMProgramError(Exception):
    """An error raised by a `%%lmprogram` cell; `error` is the original exception, `lineno` the
    line it points at: of the gen or select that failed in the runtime (invalid regex, prompt
    too long), else of the cell code that raised; None when neither is known. `filename` is the
    cell's, or a named program's cell when a gen of a program it called failed. `hint` is a
    last line saying what to do (the runtime failed: reload it)."""

    def __init__(self, error: BaseException, source: CellSource, *,
                 hint: str | None = None) -> None:
        self.error = error
        self.cause = _root_cause(error)
        self.hint = hint
        self.source = source
        self.filename = source.filename
        gen_line = _gen_line(self.cause) or _gen_line(error)
        if gen_line is not None:
            self.filename, self.lineno = gen_line
        else:
            self.lineno = _cell_lineno(error, source.filename)
            if self.lineno is None and self.cause is not error:
                self.lineno = _cell_lineno(self.cause, source.filename)
        if self.filename == source.filename:
            self.line = source.line(self.lineno)
        else:
            self.line = linecache.getline(self.filename, self.lineno or 0).rstrip("\n") or None
        super().__init__(self.summary)

    @property
    def summary(self) -> str:
        if isinstance(self.cause, SyntaxError):
            return f"SyntaxError: {self.cause.msg}"
        return f"{type(self.cause).__name__}: {self.cause}"

    @property
    def notes(self) -> list[str]:
        """What the summary leaves out: the errors it was raised from, and the hint."""
        notes = [f"caused by: {type(cause).__name__}: {cause}" for cause in _causes(self.cause)]
        return notes if self.hint is None else [*notes, self.hint]

    def _render_traceback_(self) -> list[str]:
        if self.lineno is None:
            return [f"  {self.source.filename}, while running the program", self.summary,
                    *self.notes]
        lines = [f"  {self.filename}, line {self.lineno}"]
        if self.line is not None:
            code = self.line.lstrip()
            lines.append(f"    {code}")
            if isinstance(self.cause, SyntaxError) and self.cause.offset:
                column = self.cause.offset - 1 - (len(self.line) - len(code))
                lines.append("    " + " " * max(column, 0) + "^")
        return [*lines, self.summary, *self.notes]


class LMProgramInterrupted(KeyboardInterrupt):
    """A blocking cell was interrupted: its requests were aborted and their KV cache freed."""

    def __init__(self) -> None:
        super().__init__("the program was interrupted; its requests were aborted")

    def _render_traceback_(self) -> list[str]:
        return [f"KeyboardInterrupt: {self.args[0]}"]
