"""Compiled programs: trace once, then run the graph with one executor per traced state.

    compiled = qa.compile()     # TracingError if Python control flow depends on generated values
    print(compiled)             # the graph
    state = compiled.run(question="...", temperature=0)   # a ProgramState, as from qa.run(...)

A run submits all of the root's nodes at once (a branch's, when it is forked); no Python code of
the program runs again. Where a node needs something not known yet, its executor's worker waits:

    state 0   text  gen a  capture@2  "You said {s0.a}"  fork point  ...  join 1, 2
                              |          ^ resolved from capture@2    |             ^
                              +----------+                            v             |
    state 1                                          (forked here)  text  gen idea -+

A capture snapshots a state's variables after its first `position` nodes, where the traced program
read them (`s["a"]`); a fork point forks the executor there and submits each branch's nodes.
"""

from __future__ import annotations

import asyncio
import inspect
import weakref
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import singledispatchmethod
from typing import TYPE_CHECKING, Any

from lmnb.lang.backends.base import Backend, ProgramAborted
from lmnb.lang.batch import BatchArguments, BatchJob, BatchRunnable
from lmnb.lang.default_backend import as_backend
from lmnb.lang.interpreter import JoinBranches, ProgramError, StreamExecutor
from lmnb.lang.ir import (
    Argument,
    CommitPrefix,
    Expr,
    ForkItem,
    GenParams,
    Join,
    Variable,
    to_expr,
)
from lmnb.lang.program_run import ProgramRun
from lmnb.lang.program_state import ProgramState
from lmnb.lang.run_defaults import batch_defaults, call_arguments, run_defaults
from lmnb.lang.tracer import (
    Call,
    Fork,
    Ref,
    TracedProgram,
    refs_of,
    substitute,
    trace_program,
)

if TYPE_CHECKING:
    from lmnb.lang.program import Program

Read = tuple[int, int, str]  # (state, position, variable): its value after `position` nodes


# ---- the plan: the traced graph, with the reads between states made explicit ---------------------
@dataclass(frozen=True)
class _Step:
    node: Any
    reads: tuple[Read, ...]
    constant: bool  # no argument or variable in it


class _Plan:
    def __init__(self, traced: TracedProgram) -> None:
        self.traced = traced
        self.parents = {state.state_id: state.parent for state in traced.states}
        self.steps = {state.state_id: [self._step(node, order)
                                       for node, order in zip(state.nodes, state.order,
                                                              strict=True)]
                      for state in traced.states}
        self.ret = self._step(traced.ret_value, traced.ret_order)
        self.captures = {(state_id, position) for step in self._all_steps()
                         for state_id, position, _ in step.reads}

    def _all_steps(self) -> list[_Step]:
        return [step for steps in self.steps.values() for step in steps] + [self.ret]

    def _step(self, node: Any, order: int) -> _Step:
        refs = refs_of(node)
        states = self.traced.states
        reads = {(ref.state_id, bisect_left(states[ref.state_id].order, order), ref.name)
                 for ref in refs if isinstance(ref, Variable)}
        return _Step(node, tuple(sorted(reads)), not refs)


# ---- nodes only a graph executor runs ------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class _Capture(Expr):
    run: _GraphRun
    state_id: int
    position: int


@dataclass(frozen=True, eq=False)
class _Resolve(Expr):
    """`expr` with its arguments and variables substituted (waiting for the variables)."""

    run: _GraphRun
    expr: Any
    reads: tuple[Read, ...]


@dataclass(frozen=True, eq=False)
class _SetReturn(Expr):
    run: _GraphRun
    reads: tuple[Read, ...]


@dataclass(frozen=True, eq=False)
class _ForkPoint(Expr):
    run: _GraphRun
    branch_ids: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class _CallPoint(Expr):
    """Starts the executor of a called program's state (empty text, the caller's defaults
    under the call's own)."""

    run: _GraphRun
    call: Call


@dataclass(frozen=True, eq=False)
class _AwaitCalls(Expr):
    """The end of a state that called programs: it is done when they are (their errors are
    its errors)."""

    run: _GraphRun
    state_ids: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class _JoinAt(Expr):
    run: _GraphRun
    branch_ids: tuple[int, ...]
    mode: str


class GraphExecutor(StreamExecutor):
    """A `StreamExecutor` that also runs the compiler's nodes (captures, reads, fork points)."""

    graph: _GraphRun | None = None

    @singledispatchmethod
    async def _execute(self, expr: Expr) -> None:
        await super()._execute(expr)

    @_execute.register
    async def _(self, expr: _Capture) -> None:
        expr.run.captured(expr.state_id, expr.position, dict(self.variables))

    @_execute.register
    async def _(self, expr: _Resolve) -> None:
        await self._run(to_expr(await expr.run.aresolve(expr.expr, expr.reads, self)))

    @_execute.register
    async def _(self, expr: _SetReturn) -> None:
        expr.run.set_return(await expr.run.aresolve(expr.run.plan.ret.node, expr.reads, self))

    @_execute.register
    async def _(self, expr: _ForkPoint) -> None:
        expr.run.start(expr.branch_ids, self.fork(len(expr.branch_ids)))

    @_execute.register
    async def _(self, expr: _CallPoint) -> None:
        call = expr.call
        defaults = run_defaults({**self.defaults.set_values(), **dict(call.defaults)})
        child = GraphExecutor(self.backend, defaults=defaults, stream=self.stream,
                              num_api_spec_tokens=call.num_api_spec_tokens)
        child.observer = self.observer
        self._emit("fork", branches=[child])  # live views show it beside the caller
        expr.run.start([call.state_id], [child])

    @_execute.register
    async def _(self, expr: _AwaitCalls) -> None:
        for state_id in expr.state_ids:
            child = await expr.run.executor(state_id, self)
            await child.drained()
            if child.error is not None:
                raise ProgramError(f"state {state_id} of the program failed: "
                                   f"{child.error!r}") from child.error

    @_execute.register
    async def _(self, expr: _JoinAt) -> None:
        branches = tuple([await expr.run.executor(i, self) for i in expr.branch_ids])
        await self._run(JoinBranches(branches, expr.mode))

    def _fail(self, error: BaseException) -> None:
        super()._fail(error)
        if self.graph is not None:
            self.graph.changed()

    def abort(self) -> None:
        if self.graph is None:
            super().abort()
        else:
            self.graph.abort()


# ---- one run of the graph ------------------------------------------------------------------------
class _Box:
    def __init__(self) -> None:
        self.ready = _Flag()
        self.values: dict[str, Any] = {}


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _Flag:
    """Set once, on the program loop; awaited there (with the waiter's cancel and the setting
    state's failure as the other ways out)."""

    def __init__(self) -> None:
        self.is_set = False
        self._waiters: list[asyncio.Future[None]] = []

    def set(self) -> None:
        self.is_set = True
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            _resolve(waiter)

    def waiter(self) -> asyncio.Future[None]:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        return waiter


class _GraphRun:
    """The executors of one run, created as the program forks, and the values they hand on."""

    def __init__(self, plan: _Plan, arguments: dict[str, Any], state: ProgramState) -> None:
        self.plan = plan
        self.arguments = arguments
        self.executors: dict[int, GraphExecutor] = {}
        self._created: defaultdict[int, _Flag] = defaultdict(_Flag)
        self._boxes = {key: _Box() for key in plan.captures}
        self._changes: list[asyncio.Future[None]] = []  # waits to wake when a state starts/fails
        self._state = weakref.ref(state)

    # ---- starting states -----------------------------------------------------------------
    def start(self, state_ids: Sequence[int], executors: Sequence[StreamExecutor]) -> None:
        """Registers the executors of `state_ids` and submits their nodes."""
        for state_id, executor in zip(state_ids, executors, strict=True):
            executor.graph = self  # type: ignore[attr-defined]
            self.executors[state_id] = executor  # type: ignore[assignment]
            self._created[state_id].set()
        self.changed()
        for state_id, executor in zip(state_ids, executors, strict=True):
            for expr in self._exprs(state_id):
                executor.submit(expr)
            if state_id != 0:
                executor.close()  # branches are never written to again

    def _exprs(self, state_id: int) -> list[Expr]:
        steps = self.plan.steps[state_id]
        exprs: list[Expr] = []
        for position, step in enumerate([*steps, None]):
            if (state_id, position) in self._boxes:
                exprs.append(_Capture(self, state_id, position))
            if step is not None:
                exprs.extend(self._translate(step.node, step))
        if state_id == 0 and self.plan.ret.reads:
            exprs.append(_SetReturn(self, self.plan.ret.reads))
        calls = tuple(step.node.state_id for step in steps if isinstance(step.node, Call))
        if calls:
            exprs.append(_AwaitCalls(self, calls))
        return exprs

    @singledispatchmethod
    def _translate(self, node: Expr, step: _Step) -> list[Expr]:
        return [node] if step.constant else [_Resolve(self, node, step.reads)]

    @_translate.register
    def _(self, node: ForkItem, step: _Step) -> list[Expr]:
        return []  # the executor was forked from its parent there

    @_translate.register
    def _(self, node: Fork, step: _Step) -> list[Expr]:
        commit = [CommitPrefix()] if len(node.branch_ids) > 1 else []
        return [*commit, _ForkPoint(self, node.branch_ids)]

    @_translate.register
    def _(self, node: Call, step: _Step) -> list[Expr]:
        return [_CallPoint(self, node)]

    @_translate.register
    def _(self, node: Join, step: _Step) -> list[Expr]:
        return [_JoinAt(self, node.branch_ids, node.mode)]

    # ---- values between states -----------------------------------------------------------
    def captured(self, state_id: int, position: int, variables: dict[str, Any]) -> None:
        box = self._boxes[(state_id, position)]
        box.values = variables
        box.ready.set()

    def resolve(self, value: Any) -> Any:
        """`value` with its arguments substituted (it reads no variable)."""
        return self._substituted(value, {})

    async def aresolve(self, value: Any, reads: tuple[Read, ...], waiter: StreamExecutor) -> Any:
        """`value` with arguments and variables substituted; waits for the variables."""
        values: dict[tuple[int, str], Any] = {}
        for state_id, position, name in reads:
            box = self._boxes[(state_id, position)]
            await self._wait(box.ready, state_id, waiter)
            if name not in box.values:
                raise KeyError(f"the program set no variable {name!r}")
            values[(state_id, name)] = box.values[name]
        return self._substituted(value, values)

    def _substituted(self, value: Any, values: dict[tuple[int, str], Any]) -> Any:

        def lookup(ref: Ref) -> Any:
            if isinstance(ref, Argument):
                return self.arguments[ref.name]
            return values[(ref.state_id, ref.name)]

        return substitute(value, lookup)

    async def executor(self, state_id: int, waiter: StreamExecutor) -> GraphExecutor:
        await self._wait(self._created[state_id], self.plan.parents[state_id], waiter)
        return self.executors[state_id]

    async def _wait(self, flag: _Flag, state_id: int | None, waiter: StreamExecutor) -> None:
        """Waits for `flag`, set by state `state_id`'s executor (or a parent's, which makes it);
        fails if the waiter is aborted or that state fails first."""
        loop = asyncio.get_running_loop()
        while not flag.is_set:
            if waiter.cancel.is_set():
                raise ProgramAborted("the program was interrupted")
            error = self._failure(state_id)
            if error is not None:
                raise ProgramError(f"state {state_id} of the program failed: {error!r}") from error
            woken = flag.waiter()
            self._changes.append(woken)
            remove = waiter.cancel.on_set(lambda w=woken: loop.call_soon_threadsafe(_resolve, w))
            try:
                await woken
            finally:
                remove()

    def changed(self) -> None:
        """A state of the run started or failed: waits re-check their way out."""
        changes, self._changes = self._changes, []
        for waiter in changes:
            _resolve(waiter)

    def _failure(self, state_id: int | None) -> BaseException | None:
        while state_id is not None:
            executor = self.executors.get(state_id)
            if executor is not None:
                return executor.error
            state_id = self.plan.parents[state_id]
        return None

    def set_return(self, value: Any) -> None:
        state = self._state()
        if state is not None:
            state.ret_value = value

    def abort(self) -> None:
        for executor in list(self.executors.values()):
            StreamExecutor.abort(executor)


# ---- the compiled program ------------------------------------------------------------------------
class CompiledProgram(BatchRunnable):
    """A program traced once (arguments symbolic, bound ones constant) and run as a graph: the same
    results as `Program.run`, with no Python code of the program run again."""

    def __init__(self, program: Program) -> None:
        self.program = program
        self.__name__ = program.__name__
        self.traced = trace_program(program, dict(program.bound))
        self._plan = _Plan(self.traced)
        self._signature = inspect.signature(program.func)

    def _arguments(self, args: tuple, kwargs: dict[str, Any]) -> tuple[dict, dict]:
        arguments, sampling = self.program.split_arguments(args, kwargs)
        for name, value in self.program.bound.items():
            if arguments[name] is not value:
                raise TypeError(f"{self.__name__}: {name!r} was bound when the program was "
                                f"compiled; compile program.bind({name}=...) instead")
        missing = []
        for name in self.traced.arguments:
            if name not in arguments:
                default = self._signature.parameters[name].default
                if default is inspect.Parameter.empty:
                    missing.append(name)
                arguments[name] = default
        if missing:
            raise TypeError(f"{self.__name__}() missing required arguments {missing}")
        return arguments, sampling

    def run(self, *args: Any, backend: Any = None, stream: bool = False,
            **kwargs: Any) -> ProgramState:
        """Runs the graph; returns its state once done (at once with `stream=True`). Keyword
        arguments named like sampling parameters are the defaults of every `gen`, as in
        `Program.run`."""
        arguments, sampling = self._arguments(args, kwargs)
        return self._execute(as_backend(backend), arguments, run_defaults(sampling), stream)

    def _execute(self, backend: Backend, arguments: dict[str, Any], defaults: GenParams,
                 stream: bool, run: ProgramRun | None = None, *,
                 wait: bool = True) -> ProgramState:
        root = GraphExecutor(backend, defaults=defaults, stream=stream,
                             num_api_spec_tokens=self.program.num_api_spec_tokens)
        state = ProgramState(root, run)
        run = _GraphRun(self._plan, arguments, state)
        if not self._plan.ret.reads:
            state.ret_value = run.resolve(self._plan.ret.node)
        run.start([0], [root])
        if not stream and wait:
            state.sync()
        return state

    def batch_job(self, batch_kwargs: BatchArguments, *, backend: Any,
                  sampling: dict[str, Any]) -> BatchJob:
        backend = as_backend(backend)
        defaults = batch_defaults(sampling)
        batch = [self._arguments(*call_arguments(item))[0] for item in batch_kwargs]
        return BatchJob(self.__name__, backend, self.traced.constant_text(backend.chat_template),
                        batch,
                        lambda arguments, run: self._execute(backend, arguments, defaults,
                                                             stream=False, run=run, wait=False))

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)

    def __str__(self) -> str:
        return str(self.traced)

    def __repr__(self) -> str:
        return f"<compiled lmnb program {self.__name__}({', '.join(self.program.arg_names)})>"
