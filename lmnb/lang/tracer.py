"""Tracing: run a program's function on a recording state and get its expression graph.

    traced = qa.trace()          # every argument not given stays symbolic
    print(traced)                # state 0:\n  user begin\n  argument question\n  ...

Each state (the root and every fork branch) gets a list of nodes in program order; every node also
gets a global sequence number, so that a read of another state's variable knows how far that state
had got. Symbolic values (`Argument`, `Variable`) flow through `s += ...` and `+`; using them for
Python control flow (`if`, `==`, `len`, iteration, ...) raises `TracingError`, and turning them into
Python strings (f-strings, `str()`, `format()`) raises `SymbolicTextError`, a `TypeError` as in
SGLang: a string cannot carry a value not known yet, and string operations on a stand-in would
trace a wrong graph.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import singledispatch
from typing import TYPE_CHECKING, Any, NoReturn

from lmnb.lang.chat_template import ChatTemplate
from lmnb.lang.ir import (
    Argument,
    CommitPrefix,
    Expr,
    ExprList,
    ForkItem,
    Gen,
    GenParams,
    Image,
    Join,
    RoleBegin,
    RoleEnd,
    Select,
    SetVar,
    Text,
    Variable,
    VarScopeBegin,
    VarScopeEnd,
    Video,
    join_mode,
)
from lmnb.lang.reasoning import reasoning_name
from lmnb.lang.state_writer import (
    PROGRAM_CALLER,
    ProgramStateGroup,
    StateWriter,
    position_offsets,
)

if TYPE_CHECKING:
    from lmnb.lang.backends.base import Backend

Ref = Argument | Variable


class TracingError(RuntimeError):
    """The program cannot be traced: its Python control flow depends on values not known yet."""


class SymbolicTextError(TracingError, TypeError):
    """A symbolic value was turned into a Python string (f-string, `str()`, `format()`) while
    tracing; a `TypeError`, as SGLang raises for an argument inside an f-string."""


@dataclass(frozen=True)
class Fork(Expr):
    """Tracing: fork `fork_id` of this state into the states `branch_ids`."""

    fork_id: int
    branch_ids: tuple[int, ...]


@dataclass(frozen=True)
class Call(Expr):
    """Tracing: the body called `@function` `program`, whose nodes are state `state_id` (a
    program of its own: it starts empty, with the caller's sampling defaults under `defaults`)."""

    state_id: int
    program: str
    defaults: tuple[tuple[str, Any], ...] = ()
    num_api_spec_tokens: int | None = None


def _ref_label(ref: Ref) -> str:
    return ref.name if isinstance(ref, Argument) else f"s{ref.state_id}.{ref.name}"


# ---- walking values that may hold symbolic references --------------------------------------------
OnRef = Callable[[Ref], Any]


@singledispatch
def _walk(value: Any, on_ref: OnRef) -> Any:
    return value


@_walk.register(Argument)
@_walk.register(Variable)
def _(value: Ref, on_ref: OnRef) -> Any:
    return on_ref(value)


@_walk.register(tuple)
@_walk.register(list)
def _(value: tuple | list, on_ref: OnRef) -> Any:
    items = [_walk(item, on_ref) for item in value]
    if all(new is old for new, old in zip(items, value, strict=True)):
        return value
    return type(value)(items)


@_walk.register
def _(value: dict, on_ref: OnRef) -> Any:
    items = {key: _walk(item, on_ref) for key, item in value.items()}
    return value if all(items[k] is value[k] for k in value) else items


@_walk.register(Expr)
@_walk.register(GenParams)
def _(value: Any, on_ref: OnRef) -> Any:
    if not dataclasses.is_dataclass(value):
        return value
    changes = {}
    for f in dataclasses.fields(value):
        old = getattr(value, f.name)
        new = _walk(old, on_ref)
        if new is not old:
            changes[f.name] = new
    return dataclasses.replace(value, **changes) if changes else value


def substitute(value: Any, lookup: Callable[[Ref], Any]) -> Any:
    """`value` with every `Argument`/`Variable` replaced by its value; unchanged parts keep their
    identity."""
    return _walk(value, lookup)


def refs_of(value: Any) -> list[Ref]:
    """Every `Argument`/`Variable` in `value`, in order."""
    found: list[Ref] = []

    def on_ref(ref: Ref) -> Ref:
        found.append(_plain(ref))
        return ref

    _walk(value, on_ref)
    return found


def _plain(ref: Ref) -> Ref:
    return Argument(ref.name) if isinstance(ref, Argument) else Variable(ref.name, ref.state_id)


def normalize(value: Any) -> Any:
    """`value` with the tracer's symbolic proxies replaced by plain IR nodes."""
    return _walk(value, _plain)


# ---- symbolic values -----------------------------------------------------------------------------
class _Symbolic:
    """Python operations on a value that is not known while tracing: data flow works, control
    flow raises `TracingError`."""

    def _label(self) -> str:
        if isinstance(self, Argument):
            return f"argument {self.name!r}"
        return f"variable {self.name!r} of state {self.state_id}"  # type: ignore[attr-defined]

    def _control(self, use: str) -> NoReturn:
        raise TracingError(
            f"data-dependent control flow: {self._label()} is {use}, but its value is not known "
            f"while tracing. Compiled programs may only pass such values on (s += ..., +); run "
            f"the program with .run() to branch on them")

    def _as_text(self, use: str) -> NoReturn:
        name = self.name  # type: ignore[attr-defined]
        example = name if isinstance(self, Argument) else f"s[{name!r}]"
        raise SymbolicTextError(
            f"cannot put {self._label()} inside {use} while tracing: its value is not known yet "
            f"(SGLang raises this TypeError too); concatenate it instead: "
            f"s += \"...\" + {example}")

    def __str__(self) -> str:
        self._as_text("str()")

    def __format__(self, spec: str) -> str:
        self._as_text("an f-string or format()")

    def __repr__(self) -> str:
        return f"<symbolic {self._label()}>"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Expr):
            return normalize(self) == normalize(other)
        self._control(f"compared (==) with {other!r}")

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(_plain(self))  # type: ignore[arg-type]

    def __bool__(self) -> bool:
        self._control("used as a truth value (if, while, and, or, not)")

    def __len__(self) -> int:
        self._control("passed to len()")

    def __iter__(self) -> Iterator[Any]:
        self._control("iterated over")

    def __contains__(self, item: object) -> bool:
        self._control("searched with `in`")

    def __getitem__(self, key: object) -> Any:
        self._control(f"indexed with [{key!r}]")

    def __int__(self) -> int:
        self._control("converted with int()")

    def __float__(self) -> float:
        self._control("converted with float()")

    def __index__(self) -> int:
        self._control("used as an integer (range, indexing, *)")

    def __lt__(self, other: object) -> bool:
        self._control("compared (<)")

    def __le__(self, other: object) -> bool:
        self._control("compared (<=)")

    def __gt__(self, other: object) -> bool:
        self._control("compared (>)")

    def __ge__(self, other: object) -> bool:
        self._control("compared (>=)")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # protocols and probes (hasattr) see a plain missing attribute
            raise AttributeError(name)
        self._control(f"used with .{name}")


class SymbolicArgument(_Symbolic, Argument):
    """A program argument while tracing."""


class SymbolicVariable(_Symbolic, Variable):
    """`s["name"]` while tracing."""


# ---- the traced graph ----------------------------------------------------------------------------
@dataclass
class TracedState:
    """One state of the graph: the root (0) or a fork branch."""

    state_id: int
    parent: int | None = None
    fork_id: int | None = None
    index: int | None = None
    call: str | None = None  # the program called from state `parent` (a nested @function)
    nodes: list[Expr] = field(default_factory=list)
    order: list[int] = field(default_factory=list)  # global sequence number of each node

    def label(self) -> str:
        if self.parent is None:
            return f"state {self.state_id}"
        if self.call is not None:
            return f"state {self.state_id} ({self.call} called from state {self.parent})"
        return (f"state {self.state_id} (fork #{self.fork_id} branch {self.index} of state "
                f"{self.parent})")


class TracedProgram:
    """The expression graph of one program: per state, its nodes in program order."""

    def __init__(self, name: str, states: list[TracedState], arguments: tuple[str, ...],
                 ret_value: Any, ret_order: int) -> None:
        self.name = name
        self.states = tuple(states)
        self.arguments = arguments
        self.ret_value = ret_value
        self.ret_order = ret_order

    def nodes(self, state_id: int = 0) -> tuple[Expr, ...]:
        return tuple(self.states[state_id].nodes)

    @property
    def last_node(self) -> Expr | None:
        """The root state's last node (SGLang's `last_node`), None for an empty program."""
        nodes = self.states[0].nodes
        return nodes[-1] if nodes else None

    @property
    def variables(self) -> dict[int, tuple[str, ...]]:
        """Per state, the names of the variables it sets (in order of first setting)."""
        names: dict[int, tuple[str, ...]] = {}

        def of(state_id: int) -> tuple[str, ...]:
            if state_id not in names:
                names[state_id] = ()
                nodes = self.states[state_id].nodes
                names[state_id] = tuple(dict.fromkeys(
                    name for node in nodes for name in _sets(node, of)))
            return names[state_id]

        for state in self.states:
            of(state.state_id)
        return names

    def constant_text(self, chat_template: ChatTemplate) -> str:
        """The text state 0 produces before its first node that is not a compile-time constant."""
        prefix = _Prefix(chat_template)
        try:
            for node in self.states[0].nodes:
                if not _constant_piece(node, prefix):
                    break
        except ValueError:  # a role the chat template cannot render here: the run will say so
            pass
        return prefix.text

    def __str__(self) -> str:
        lines = []
        for state in self.states:
            lines.append(f"{state.label()}:")
            lines.extend(f"  {describe(node)}" for node in state.nodes)
        if self.ret_value is not None:
            lines.append(f"returns {_show(self.ret_value)}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"<traced program {self.name}: {len(self.states)} states, "
                f"{sum(len(s.nodes) for s in self.states)} nodes>")


@singledispatch
def _sets(node: Expr, of: Callable[[int], tuple[str, ...]]) -> tuple[str, ...]:
    """The variables `node` sets; `of(state)` gives those a branch sets (for joins)."""
    return ()


@_sets.register(Gen)
@_sets.register(Select)
def _(node: Gen | Select, of: Callable[[int], tuple[str, ...]]) -> tuple[str, ...]:
    if node.name is None:
        return ()
    return (node.name,) if node.reasoning is None else (node.name, reasoning_name(node.name))


@_sets.register(SetVar)
@_sets.register(VarScopeEnd)
def _(node: SetVar | VarScopeEnd, of: Callable[[int], tuple[str, ...]]) -> tuple[str, ...]:
    return (node.name,)


@_sets.register
def _(node: Join, of: Callable[[int], tuple[str, ...]]) -> tuple[str, ...]:
    if node.mode != "gather_variable":
        return ()
    return tuple(name for branch in node.branch_ids for name in of(branch))


# ---- printing ------------------------------------------------------------------------------------
def _show(value: Any) -> str:
    if isinstance(value, Argument | Variable):
        return "{" + _ref_label(value) + "}"
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return repr(value)


def _params(values: dict[str, Any]) -> str:
    return " (" + ", ".join(f"{k}={_show(v)}" for k, v in values.items()) + ")" if values else ""


def _reasoning(node: Gen | Select) -> str:
    return "" if node.reasoning is None else f" [separate_reasoning {node.reasoning}]"


def _source(node: Image | Video) -> str:
    return _show(node.source) if isinstance(node.source, str | Expr) else "<data>"


_DESCRIBE: dict[type, Callable[[Any], str]] = {
    Text: lambda n: f"text {_show(n.value)}",
    Argument: lambda n: f"argument {n.name}",
    Variable: lambda n: f"variable {n.name} of state {n.state_id}",
    Gen: lambda n: f"gen {n.name or '_'}{_params(n.params.set_values())}{_reasoning(n)}",
    Select: lambda n: f"select {n.name or '_'} {_show(n.choices)} ({n.method}){_reasoning(n)}",
    RoleBegin: lambda n: f"{n.role} begin",
    RoleEnd: lambda n: f"{n.role} end",
    VarScopeBegin: lambda n: f"var_scope {n.name} begin",
    VarScopeEnd: lambda n: f"var_scope {n.name} end",
    SetVar: lambda n: f"set_var {n.name} = {_show(n.value)}",
    CommitPrefix: lambda n: "commit_prefix",
    Image: lambda n: f"image {_source(n)}",
    Video: lambda n: f"video {_source(n)} ({n.num_frames} frames)",
    Fork: lambda n: f"fork #{n.fork_id} -> states {', '.join(map(str, n.branch_ids))}",
    Call: lambda n: f"call {n.program} -> state {n.state_id}{_params(dict(n.defaults))}",
    ForkItem: lambda n: f"fork item: branch {n.index} of fork #{n.fork_id} of state {n.state_id}",
    Join: lambda n: f"join {n.mode} <- states {', '.join(map(str, n.branch_ids))}",
}


def describe(node: Expr) -> str:
    """One line for one node of a traced graph."""
    return _DESCRIBE.get(type(node), repr)(node)


# ---- constant prefix -----------------------------------------------------------------------------
@dataclass
class _Prefix:
    chat_template: ChatTemplate
    text: str = ""
    first: bool = True  # no message finished yet (the interpreter's `not messages_`)


@singledispatch
def _constant_piece(node: Expr, prefix: _Prefix) -> bool:
    """Adds `node`'s text to `prefix` if it is a compile-time constant; False stops the prefix."""
    return False


@_constant_piece.register
def _(node: Text, prefix: _Prefix) -> bool:
    prefix.text += node.value
    return True


@_constant_piece.register
def _(node: RoleBegin, prefix: _Prefix) -> bool:
    prefix.text += prefix.chat_template.role_text(node.role, first=prefix.first).prefix
    return True


@_constant_piece.register
def _(node: RoleEnd, prefix: _Prefix) -> bool:
    prefix.first = False
    prefix.text += prefix.chat_template.role_text(node.role, first=False).suffix
    return True


@_constant_piece.register(VarScopeBegin)
@_constant_piece.register(VarScopeEnd)
@_constant_piece.register(CommitPrefix)
@_constant_piece.register(SetVar)
@_constant_piece.register(Fork)
@_constant_piece.register(Call)
def _(node: Expr, prefix: _Prefix) -> bool:
    return True


def constant_prefix(program: Any, backend: Backend) -> str:
    """The text every run of `program` starts with (its arguments symbolic), for caching before a
    batch; "" when the program cannot be traced or starts with something not constant."""
    try:  # what was recorded before a tracing failure is still a valid head
        traced = trace_program(program, dict(program.bound), partial=True)
        return traced.constant_text(backend.chat_template)
    except Exception:  # a hint only: the run itself reports the program's errors
        return ""


# ---- the recording state -------------------------------------------------------------------------
class _Recorder:
    def __init__(self) -> None:
        self.states: list[TracedState] = []
        self.sequence = 0
        self.forks = 0

    def new_state(self, **kwargs: Any) -> TracingState:
        state = TracedState(len(self.states), **kwargs)
        self.states.append(state)
        return TracingState(self, state)

    def record(self, state: TracedState, node: Expr) -> None:
        state.nodes.append(normalize(node))
        state.order.append(self.sequence)
        self.sequence += 1


class TracingState(StateWriter):
    """The `s` of a program while tracing: the API of `ProgramState`, recording nodes."""

    def __init__(self, recorder: _Recorder, state: TracedState) -> None:
        self._recorder = recorder
        self._state = state
        self.ret_value: Any = None
        self._copy_of: TracingState | None = None  # set by `copy()`: joined back into it on exit

    @property
    def state_id(self) -> int:
        return self._state.state_id

    def _record(self, node: Expr) -> None:
        self._recorder.record(self._state, node)

    # ---- writing -------------------------------------------------------------------------
    def _submit(self, expr: Expr) -> None:
        for item in expr.items if isinstance(expr, ExprList) else (expr,):
            self._record(item)

    # ---- reading -------------------------------------------------------------------------
    def __getitem__(self, name: str) -> SymbolicVariable:
        return SymbolicVariable(name, self.state_id)

    def get_var(self, name: str) -> SymbolicVariable:
        return self[name]

    def _unknown(self, what: str) -> NoReturn:
        raise TracingError(f"data-dependent control flow: {what} of state {self.state_id} is not "
                           f"known while tracing; run the program with .run() to use it")

    def __contains__(self, name: str) -> bool:
        self._unknown(f"whether variable {name!r} is set")

    def get_meta_info(self, name: str) -> Any:
        self._unknown(f"the meta info of variable {name!r}")

    def text(self) -> str:
        self._unknown("the text")

    def messages(self) -> list[dict[str, str]]:
        self._unknown("the messages")

    def variables(self) -> dict[str, Any]:
        self._unknown("the variables")

    def spans(self) -> list[tuple[str, int, int]]:
        self._unknown("the spans")

    def text_iter(self, var_name: str | None = None,
                  return_meta_data: bool = False) -> Iterator[str]:
        self._unknown("the text")

    def error(self) -> BaseException | None:
        self._unknown("the error")

    def sync(self) -> None:
        pass

    def abort(self) -> None:
        pass

    # ---- branching -----------------------------------------------------------------------
    def fork(self, size: int = 1,
             position_ids_offset: Sequence[int] | None = None) -> ProgramStateGroup:
        if size < 1:
            raise ValueError(f"fork size must be >= 1, got {size}")
        if position_offsets(size, position_ids_offset) is not None:
            raise NotImplementedError("fork(position_ids_offset=...) cannot be traced (compile, "
                                      "run_batch's prefix hint): run the program with .run()")
        fork_id = self._recorder.forks
        self._recorder.forks += 1
        branches = [self._recorder.new_state(parent=self.state_id, fork_id=fork_id, index=i)
                    for i in range(size)]
        self._record(Fork(fork_id, tuple(b.state_id for b in branches)))
        for i, branch in enumerate(branches):
            branch._record(ForkItem(self.state_id, fork_id, i))
        return ProgramStateGroup(branches, parent=self)

    def copy(self, position_ids_offset: Sequence[int] | None = None) -> TracingState:
        """As `ProgramState.copy`: `with s.copy() as c:` joins `c` back at the block's end."""
        branch = self.fork(1, position_ids_offset)[0]
        branch._copy_of = self
        return branch

    def __enter__(self) -> TracingState:
        return self

    def __exit__(self, *exc_info: object) -> None:
        parent = self._copy_of
        if parent is not None and exc_info[0] is None:
            parent.join([self])

    def join(self, forks: ProgramStateGroup | Sequence[TracingState],
             mode: str = "gather_variable") -> None:
        self._record(Join(tuple(state.state_id for state in forks), join_mode(mode)))

    def __repr__(self) -> str:
        return f"TracingState({self.state_id}, {len(self._state.nodes)} nodes)"


class _TracingCaller:
    """A body being traced: a program it calls is traced too, into a state of its own."""

    honours_backend = False  # the graph does not depend on a backend (SGLang passes one)

    def __init__(self, recorder: _Recorder, state: TracingState) -> None:
        self.recorder = recorder
        self.state = state

    def call(self, program: Any, args: tuple, kwargs: dict[str, Any]) -> TracingState:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("backend", "stream")}
        arguments, sampling = program.split_arguments(args, kwargs)
        for name, parameter in inspect.signature(program.func).parameters.items():
            if name in program.arg_names and name not in arguments:
                if parameter.default is inspect.Parameter.empty:
                    raise TypeError(f"{program.__name__}() missing required argument {name!r}")
                arguments[name] = parameter.default
        child = self.recorder.new_state(parent=self.state.state_id, call=program.__name__)
        self.state._record(Call(child.state_id, program.__name__, tuple(sorted(sampling.items())),
                                program.num_api_spec_tokens))
        caller = PROGRAM_CALLER.set(_TracingCaller(self.recorder, child))
        try:
            child.ret_value = program.func(child, **arguments)
        finally:
            PROGRAM_CALLER.reset(caller)
        return child


def trace_program(program: Any, kwargs: dict[str, Any], *, partial: bool = False) -> TracedProgram:
    """Runs `program.func` on a recording state. Arguments missing from `kwargs` are symbolic
    (`Argument` nodes); raises `TracingError` on data-dependent control flow — unless `partial`,
    which returns what was recorded up to the failure."""
    unknown = set(kwargs) - set(program.arg_names)
    if unknown:
        raise TypeError(f"{program.__name__} has no arguments {sorted(unknown)}")
    parameters = list(inspect.signature(program.func).parameters.values())[1:]
    names = [p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    arguments = {name: kwargs[name] if name in kwargs else SymbolicArgument(name)
                 for name in names}
    recorder = _Recorder()
    root = recorder.new_state()
    caller = PROGRAM_CALLER.set(_TracingCaller(recorder, root))
    try:
        ret_value = program.func(root, **arguments)
    except Exception:
        if not partial:
            raise
        ret_value = None
    finally:
        PROGRAM_CALLER.reset(caller)
    return TracedProgram(program.__name__, recorder.states,
                         tuple(name for name in names if name not in kwargs),
                         normalize(ret_value), recorder.sequence)
