"""The writing half of a program's `s`, shared by running states (`program.py`) and tracing
states (`tracer.py`): `StateWriter`, the branches of a fork (`ProgramStateGroup`), and
`PROGRAM_CALLER`, what a `@function` called inside another program's body does. Both sides import
this module; neither imports the other for it."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from lmnb.lang import api
from lmnb.lang.ir import (
    Expr,
    RoleBegin,
    RoleEnd,
    SetVar,
    VarScopeBegin,
    VarScopeEnd,
    to_expr,
)

_ROLE_EXPRS = {"system": api.system, "user": api.user, "assistant": api.assistant}

# What a `@function` called inside another program's body does (SGLang's nested call): the
# caller's run or trace sets this while its body runs, on the body's thread.
PROGRAM_CALLER: ContextVar[Any] = ContextVar("lmnb_caller", default=None)


def position_offsets(size: int, position_ids_offset: Sequence[int] | None) -> list[int] | None:
    """`fork(size, position_ids_offset)`'s offsets, checked: SGLang's list of one int per
    branch (or None)."""
    if position_ids_offset is None:
        return None
    offsets = list(position_ids_offset)
    if len(offsets) != size or not all(isinstance(o, int) and not isinstance(o, bool)
                                       for o in offsets):
        raise ValueError(f"position_ids_offset must list one int per branch ({size}), got "
                         f"{position_ids_offset!r}")
    return offsets


def appended(value: Any) -> Expr:
    """What `s += value` appends; None is a ValueError, as in SGLang (a role method or helper
    that returns nothing, appended by mistake)."""
    if value is None:
        raise ValueError("Tried to append None to state: append a str or a DSL expression")
    return to_expr(value)


class StateWriter:
    """The writing half of `s`, shared by running and tracing states: `+=`, `set_var`,
    `var_scope`, and the roles as calls (`s.user("hi")`) or blocks (`with s.user(): ...`).
    Subclasses define `_submit(expr)`."""

    def _submit(self, expr: Expr) -> None:
        raise NotImplementedError

    def __iadd__(self, other: Any) -> Any:
        self._submit(appended(other))
        return self

    def set_var(self, name: str, value: Any) -> None:
        self._submit(SetVar(name, value))

    def __setitem__(self, name: str, value: Any) -> None:
        """`s["x"] = value`, as SGLang: the same as `s.set_var("x", value)`."""
        self.set_var(name, value)

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        self._submit(VarScopeBegin(name))
        yield
        self._submit(VarScopeEnd(name))

    @contextmanager
    def _role_scope(self, role: str) -> Iterator[None]:
        self._submit(RoleBegin(role))
        yield
        self._submit(RoleEnd(role))

    def _role(self, role: str, expr: Any) -> Any:
        if expr is not None:
            message = _ROLE_EXPRS[role](expr)
            self._submit(message)
            return message
        return self._role_scope(role)

    def system(self, expr: Any = None) -> Any:
        """`s.system("...")` appends a system message and returns it (as SGLang's, an
        expression); `with s.system():` opens one."""
        return self._role("system", expr)

    def user(self, expr: Any = None) -> Any:
        return self._role("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        return self._role("assistant", expr)

    def join(self, forks: ProgramStateGroup | Sequence[Any], mode: str = "gather_variable"
             ) -> None:
        """Merges fork branches back (running and tracing states each define it)."""
        raise NotImplementedError


class ProgramStateGroup:
    """The branches of `s.fork(n)`: `forks += expr` (all), a list (one each), or a callable of the
    branch index. Serves tracing states too (they share the `+=` / `join` API)."""

    def __init__(self, states: Sequence[StateWriter], parent: StateWriter) -> None:
        self.states = states
        self.parent = parent

    def __iter__(self) -> Iterator[StateWriter]:
        return iter(self.states)

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, index: int) -> StateWriter:
        return self.states[index]

    def __setitem__(self, index: int, state: StateWriter) -> None:
        """Completes `forks[i] += expr` (Python stores the item back after `+=`)."""
        if state is not self.states[index]:
            raise TypeError("fork branches cannot be replaced; use forks[i] += expr")

    def __iadd__(self, other: Any) -> ProgramStateGroup:
        if callable(other) and not isinstance(other, Expr):
            for i, state in enumerate(self.states):
                state += other(i)
        elif isinstance(other, list | tuple):
            if len(other) != len(self.states):
                raise ValueError(f"{len(other)} expressions for {len(self.states)} branches")
            for state, expr in zip(self.states, other, strict=True):
                state += expr
        else:
            expr = appended(other)
            for state in self.states:
                state += expr
        return self

    def join(self, mode: str = "gather_variable") -> None:
        self.parent.join(self, mode)
