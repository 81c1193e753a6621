"""Short, nbval-visible errors for `%%lmprogram` cells: the message and the offending cell line."""

from __future__ import annotations

from lmnb.magics.cell import CellSource


def _root_cause(error: BaseException) -> BaseException:
    """The error the user made, not the interpreter's wrapper that re-raised it."""
    from lmnb.lang.interpreter import ProgramError

    while isinstance(error, ProgramError) and error.__cause__ is not None:
        error = error.__cause__
    return error


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


class LMProgramError(Exception):
    """An error raised by a `%%lmprogram` cell; `error` is the original exception, `lineno` the
    cell line it points at (None when it happened inside the runtime, away from the cell)."""

    def __init__(self, error: BaseException, source: CellSource) -> None:
        self.error = error
        self.cause = _root_cause(error)
        self.source = source
        self.lineno = _cell_lineno(error, source.filename)
        if self.lineno is None and self.cause is not error:
            self.lineno = _cell_lineno(self.cause, source.filename)
        self.line = source.line(self.lineno)
        super().__init__(self.summary)

    @property
    def summary(self) -> str:
        if isinstance(self.cause, SyntaxError):
            return f"SyntaxError: {self.cause.msg}"
        return f"{type(self.cause).__name__}: {self.cause}"

    def _render_traceback_(self) -> list[str]:
        if self.lineno is None:
            return [f"  {self.source.filename}, while running the program", self.summary]
        lines = [f"  {self.source.filename}, line {self.lineno}"]
        if self.line is not None:
            code = self.line.lstrip()
            lines.append(f"    {code}")
            offset = getattr(self.cause, "offset", None)
            if isinstance(self.cause, SyntaxError) and offset:
                column = offset - 1 - (len(self.line) - len(code))
                lines.append("    " + " " * max(column, 0) + "^")
        lines.append(self.summary)
        return lines


class LMProgramInterrupted(KeyboardInterrupt):
    """A blocking cell was interrupted: its requests were aborted and their KV cache freed."""

    def __init__(self) -> None:
        super().__init__("the program was interrupted; its requests were aborted")

    def _render_traceback_(self) -> list[str]:
        return [f"KeyboardInterrupt: {self.args[0]}"]
