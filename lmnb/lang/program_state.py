"""`ProgramState`: the `s` of a running program. Its writing half (`+=`, `set_var`, roles) is
`StateWriter`'s, shared with the tracer's state; reading waits for the values."""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal, overload

from lmnb.lang.interpreter import JoinBranches, Observer, StreamExecutor
from lmnb.lang.ir import CommitPrefix, Expr, join_mode
from lmnb.lang.program_run import ProgramRun
from lmnb.lang.state_writer import ProgramStateGroup, StateWriter, position_offsets

if TYPE_CHECKING:
    from lmnb.lang.token_trace import TokenTrace
    from lmnb.widgets.token_view import TokenView


class ProgramState(StateWriter):
    """The `s` of a program: `+=` appends (never blocks), `s["var"]` waits for the value."""

    def __init__(self, executor: StreamExecutor, run: ProgramRun | None = None) -> None:
        self._executor = executor
        self._run = run or ProgramRun()
        self._run.add(executor)
        self.ret_value: Any = None
        self._copy_of: ProgramState | None = None  # the parent of `s.copy()`, joined at `with` end
        weakref.finalize(self, executor.close)

    @property
    def executor(self) -> StreamExecutor:
        """This state's executor: its fields (`text_`, `spans`, `variables`, `error`, `idle`)
        are the live view, read without waiting for the program."""
        return self._executor

    @property
    def run(self) -> ProgramRun:
        """Every executor of this program run (this state, its forks and their forks)."""
        return self._run

    # ---- writing -------------------------------------------------------------------------
    def _submit(self, expr: Expr) -> None:
        self._executor.submit(expr)

    # ---- reading -------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        return self._executor.get_var(name)

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self._executor.variables

    def get_var(self, name: str) -> Any:
        return self[name]

    def get_meta_info(self, name: str) -> Any:
        """The meta info of gen/select `name` once it is done (a gen writing it again is waited
        for, as `s[name]`); None if the program sets no such variable (as SGLang)."""
        return self._executor.get_meta_info(name)

    def text(self) -> str:
        return self._executor.text()

    def messages(self) -> list[dict[str, str]]:
        """The roles' messages, each content with its leading whitespace stripped as SGLang's
        (`executor.messages_` keeps them exact: the chat template of those gives `text()`)."""
        self.sync()
        self._executor.raise_error()
        return [{**m, "content": m["content"].lstrip()} if isinstance(m.get("content"), str)
                else dict(m) for m in self._executor.messages_]

    def variables(self) -> dict[str, Any]:
        self.sync()
        self._executor.raise_error()
        return dict(self._executor.variables)

    def spans(self) -> list[tuple[str, int, int]]:
        """(variable, start, end) character spans of generated text in `text()`."""
        self.sync()
        return list(self._executor.spans)

    @overload
    def text_iter(self, var_name: str | None = None,
                  return_meta_data: Literal[False] = False) -> Iterator[str]: ...

    @overload
    def text_iter(self, var_name: str, return_meta_data: Literal[True]
                  ) -> Iterator[tuple[str, dict[str, Any]]]: ...

    def text_iter(self, var_name: str | None = None,
                  return_meta_data: bool = False) -> Iterator[Any]:
        """Streams the text of variable `var_name` (or of the whole state) as it is generated.
        `return_meta_data` (as SGLang's `text_async_iter`; needs `var_name`): `(chunk,
        meta_info)` pairs, `meta_info` the gen's as it stood when the chunk came
        (`prompt_tokens`, `completion_tokens`, `finish_reason` once it ends, ...; `{}` on a
        backend that reports it only at the end). The last pair carries the final meta info
        (`get_meta_info(var_name)`): an extra `("", meta_info)` when the last chunk had not."""
        _check_meta_request(var_name, return_meta_data)
        return self._executor.iter_text(var_name, with_meta=return_meta_data)

    @overload
    def text_async_iter(self, var_name: str | None = None,
                        return_meta_data: Literal[False] = False) -> AsyncIterator[str]: ...

    @overload
    def text_async_iter(self, var_name: str, return_meta_data: Literal[True]
                        ) -> AsyncIterator[tuple[str, dict[str, Any]]]: ...

    def text_async_iter(self, var_name: str | None = None,
                        return_meta_data: bool = False) -> AsyncIterator[Any]:
        """`text_iter` for asyncio: `async for chunk in state.text_async_iter("answer")`, from
        any event loop."""
        _check_meta_request(var_name, return_meta_data)
        return self._executor.aiter_text(var_name, with_meta=return_meta_data)

    def error(self) -> BaseException | None:
        self.sync()
        return self._executor.error

    def sync(self) -> None:
        self._run.wait(self._executor.sync)

    # ---- branching -----------------------------------------------------------------------
    def fork(self, size: int = 1,
             position_ids_offset: Sequence[int] | None = None) -> ProgramStateGroup:
        """`size` copies of this state. The shared text is sent to the backend's cache once
        before the branches run, so their requests hit it.

        `position_ids_offset` (SGLang's: one int per branch, shifting the positions of each
        branch's new tokens) goes to an SGLang-style custom backend's own `fork_program` hook;
        lmnb's backends refuse it, as lmnb's runtime offsets no positions (SGLang's interpreter
        takes it and passes it nowhere)."""
        if size < 1:
            raise ValueError(f"fork size must be >= 1, got {size}")
        offsets = position_offsets(size, position_ids_offset)
        if offsets is not None and not self._executor.takes_position_ids_offset:
            raise NotImplementedError(
                f"fork(position_ids_offset=...) is not supported on "
                f"{type(self._executor.backend).__name__}: lmnb's runtime gives a branch's "
                f"tokens the positions that follow its prefix and offsets none")
        if size > 1:
            self._executor.submit(CommitPrefix())
        self.sync()
        self._executor.raise_error()
        branches = self._executor.fork(size, position_ids_offset=offsets)
        return ProgramStateGroup([ProgramState(b, self._run) for b in branches], parent=self)

    def copy(self, position_ids_offset: Sequence[int] | None = None) -> ProgramState:
        """One fork of this state. As in SGLang, `with s.copy() as c:` joins it back when the
        block ends (`gather_variable`: its new variables become one-item lists in `s`)."""
        branch = self.fork(1, position_ids_offset)[0]
        branch._copy_of = self
        return branch

    def __enter__(self) -> ProgramState:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._copy_of is not None and exc_info[0] is None:
            self._copy_of.join([self])
        self._executor.close()  # what was submitted still runs; reads keep working

    def join(self, forks: ProgramStateGroup | Sequence[ProgramState],
             mode: str = "gather_variable") -> None:
        """Merges branches: `gather_variable` makes each variable the parent does not have a
        list of the values of the branches that set it, in branch order; `concat_and_append`
        (or SGLang's `concate_and_append`) appends each branch's new text in order."""
        branches = tuple(state.executor for state in forks)
        self._executor.submit(JoinBranches(branches, join_mode(mode)))

    def abort(self) -> None:
        self._run.abort()

    @property
    def token_trace(self) -> TokenTrace | None:
        """This state's recorded tokens when its run was traced (`run(..., token_view=True)`,
        `%%lmprogram --tokens`), else None."""
        return self._executor.token_trace

    def token_view(self, *, title: str = "", hz: float = 10.0) -> TokenView:
        """A `lmnb.widgets.TokenView` of this state's run (its forks one row each), live while
        it runs, redrawn at most `hz` times a second; the run must have been traced
        (`run(..., token_view=True)`)."""
        from lmnb.widgets.token_view import TokenView

        return TokenView(self, title=title, hz=hz)

    def observe(self, observer: Observer | None) -> None:
        """Calls `observer(kind, executor, data)` on this run's events (text deltas, finished
        variables, forks, errors) from the program loop; used by live widgets."""
        self._run.observe(observer)

    @property
    def state_id(self) -> int:
        return self._executor.id

    @property
    def idle(self) -> bool:
        return self._executor.idle

    def __repr__(self) -> str:
        """SGLang's form, `ProgramState(<text>)`; the text so far while the program runs (a
        repr never waits)."""
        return f"ProgramState({self._executor.text_})"


def _check_meta_request(var_name: str | None, return_meta_data: bool) -> None:
    if return_meta_data and var_name is None:
        raise ValueError("return_meta_data=True streams one gen's meta info: give its variable "
                         "name (text_iter(var_name, return_meta_data=True))")
