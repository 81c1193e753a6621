"""`StreamExecutor`: runs one program state's expressions, in order, as a task on the program
loop (`lmnb.lang.event_loop`; no thread of its own).

`submit` never blocks (from any thread); readers (`get_var`, `text`) wait for what they need:
`block_on` from a thread or a body greenlet, or the coroutines (`drained`, `var_ready`) on the
loop. The executor's fields change only on the loop. The first error stops the stream, is kept,
and is raised to every later reader.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Collection, Coroutine, Iterator
from dataclasses import dataclass, replace
from functools import singledispatchmethod
from typing import TYPE_CHECKING, Any

from lmnb.lang.backend_calls import BackendCalls
from lmnb.lang.backends.awaiting import in_thread
from lmnb.lang.backends.base import (
    Backend,
    CancelEvent,
    ChatPrompt,
    Generation,
    MediaInput,
    MediaUnsupported,
    ProgramAborted,
    end_program,
    takes_position_ids_offset,
)
from lmnb.lang.event_loop import block_on, call_soon, on_loop, on_program_loop, program_loop
from lmnb.lang.ir import (
    CommitPrefix,
    Expr,
    ExprList,
    Gen,
    GenParams,
    Image,
    RoleBegin,
    RoleEnd,
    Select,
    SetVar,
    Text,
    VarScopeBegin,
    VarScopeEnd,
    Video,
)
from lmnb.lang.program_error import ProgramError as ProgramError
from lmnb.lang.program_error import located
from lmnb.lang.reasoning import reasoning_name, split_reasoning
from lmnb.lang.run_defaults import merged_over_defaults
from lmnb.lang.speculation import Served, Speculation, can_serve, can_start, speculative_params
from lmnb.lang.text_listener import FAILED, TextListener, TextListeners, delivered

if TYPE_CHECKING:
    from lmnb.lang.token_trace import TokenTrace


@dataclass(frozen=True)
class JoinBranches(Expr):
    """Interpreter-only node: merge forked executors back into this one."""

    branches: tuple[StreamExecutor, ...]
    mode: str


_CLOSE = object()  # a state's last item (`close`): later ones are dropped
_executor_ids = itertools.count()

# observer(kind, executor, data): kind is "text" (data: delta, var), "variable" (name), "fork"
# (branches), or "error" (error). Called on the program loop (a fork: where it forks); must not
# block.
Observer = Callable[[str, "StreamExecutor", dict[str, Any]], None]


@functools.cache
def _dispatcher(cls: type) -> Callable[[type], Callable[..., Coroutine[Any, Any, None]]]:
    """The `_execute` handler lookup of an executor class (its singledispatch registry, read
    once: the bound `singledispatchmethod` is rebuilt on every attribute access)."""
    for klass in cls.__mro__:
        method = vars(klass).get("_execute")
        if isinstance(method, singledispatchmethod):
            return method.dispatcher.dispatch
    raise TypeError(f"{cls.__name__} has no _execute")


def written_names(expr: Expr) -> set[str]:
    """The variables running `expr` sets (its gens, selects, var scopes, set vars)."""
    if isinstance(expr, ExprList):
        return set().union(*map(written_names, expr.items))
    if isinstance(expr, Gen | Select) and expr.name is not None:
        reasoning = {reasoning_name(expr.name)} if expr.reasoning is not None else set()
        return {expr.name, *reasoning}
    if isinstance(expr, VarScopeEnd | SetVar):
        return {expr.name}
    return set()


def first_sample_meta(meta: Any) -> dict[str, Any] | None:
    """A variable's meta info as its text readers get it (`iter_text(with_meta=True)`): the
    first sample's when a gen drew several (the state's text is the first sample's)."""
    if isinstance(meta, list):
        meta = meta[0] if meta else None
    return meta if isinstance(meta, dict) else None


class StreamExecutor:
    def __init__(self, backend: Backend, *, defaults: GenParams, stream: bool = False,
                 num_api_spec_tokens: int | None = None) -> None:
        self.id = next(_executor_ids)
        self.observer: Observer | None = None
        self.backend = backend
        self.defaults = defaults
        self.stream = stream
        self.num_api_spec_tokens = num_api_spec_tokens
        # Backends of chat models are given the conversation as messages (`ChatPrompt`).
        self.chat = backend.is_chat_model
        self.text_ = ""
        self.messages_: list[dict[str, str]] = []
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.spans: list[tuple[str, int, int]] = []  # (variable, start, end) of generated text
        # Images and videos in prompt order, each with where its token starts in `text_`.
        self.media_: list[tuple[int, MediaInput]] = []
        self.turns: list[tuple[str, int, int]] = []  # (role, start, end) of each ended role
        self.error: BaseException | None = None
        self.token_trace: TokenTrace | None = None  # a traced run's tokens (token_trace.py)
        self.fork_point = 0  # length of the text inherited from the parent (forks)
        self.cancel = CancelEvent()
        self._role: str | None = None
        self._role_start = 0
        self._streaming: tuple[str | None, int] | None = None  # (variable, start) of a running gen
        self._stream_meta: dict[str, Any] = {}  # the running gen's meta info so far
        self._text_meta: dict[str, Any] = {}  # ... as it stood at its last streamed delta
        self._scopes: dict[str, int] = {}
        self._spec: Speculation | None = None  # API speculation: what the model should write next
        self._spec_turn: int | None = None  # chat: the turn (its start) speculated already
        self._finished: set[str] = set()  # variables whose value is final
        self._last_write: dict[str, int] = {}  # per variable, the last item submitted writing it
        self._listeners = TextListeners()
        self._waiters: list[asyncio.Future[None]] = []  # loop-side waits, woken on any progress
        # The queue: items appended from any thread, run in order by one task at a time.
        self._lock = threading.RLock()  # RLock: a finalizer may `close()` on the loop thread
        self._items: deque[Any] = deque()
        self._submitted = 0  # items submitted (the end included)
        self._done = 0  # items run, or dropped after an error or the end
        self._draining = False  # a task runs the queue
        self._task: asyncio.Task[None] | None = None
        self._closed = False  # the end has run
        self._loop = program_loop()
        self._calls = BackendCalls(backend)
        # A custom backend in SGLang's shape gets its hooks called with this executor.
        self.sglang_backend = self._calls.sglang
        if self.sglang_backend is not None:
            self.sglang_backend.begin_program(self)

    # ---- caller side -----------------------------------------------------------------------
    def submit(self, expr: Expr) -> None:
        if self._closed:
            raise ProgramError("this program state is closed")
        # a variable written again is not final until the new value is (SGLang's submit resets
        # its event): `s += gen("x"); s["x"]` in a loop reads each gen's own value, and a read
        # after several gens writing it, the last one's
        self._push(expr, written_names(expr))

    def close(self) -> None:
        """Ends the state once what was submitted has run (later submits are dropped)."""
        self._push(_CLOSE)

    def _push(self, item: Any, writes: Collection[str] = ()) -> None:
        with self._lock:
            for name in writes:
                self._last_write[name] = self._submitted
            self._finished.difference_update(writes)
            self._items.append(item)
            self._submitted += 1
            if self._draining:
                return
            self._draining = True
        if on_program_loop():  # a body on the loop: the task starts at the loop's next turn
            self._start()
        else:
            call_soon(self._start)

    def _start(self) -> None:
        self._task = self._loop.create_task(self._drain())

    def drained(self) -> Coroutine[Any, Any, None]:
        """Awaitable on the loop: everything submitted until now has run."""
        target = self._submitted
        return self._until(lambda: self._done >= target)

    def var_ready(self, name: str) -> Coroutine[Any, Any, None]:
        """Awaitable on the loop: variable `name` is final, or the program failed, or everything
        submitted has run."""
        return self._until(lambda: name in self._finished or self.error is not None
                           or self._done >= self._submitted)

    def sync(self) -> None:
        """Waits until everything submitted so far has run."""
        if self._done < self._submitted:
            block_on(self.drained())

    def abort(self) -> None:
        """Interrupts the running request (freeing its KV) and drops what is queued."""
        self.cancel.set()

    def raise_error(self) -> None:
        if self.error is not None:
            raise ProgramError(f"the program failed: {self.error!r}") from self.error

    def get_var(self, name: str) -> Any:
        if name not in self._finished and self.error is None and not self.idle:
            block_on(self.var_ready(name))
        self.raise_error()
        if name not in self.variables:
            raise KeyError(f"the program set no variable {name!r}")
        return self.variables[name]

    def get_meta_info(self, name: str) -> Any:
        """The meta info of `name` once its value is final (None if it has none)."""
        if name not in self._finished and self.error is None and not self.idle:
            block_on(self.var_ready(name))
        if name not in self._finished:
            self.raise_error()
        return self.meta_info.get(name)

    def text(self) -> str:
        self.sync()
        self.raise_error()
        return self.text_

    def iter_text(self, var: str | None = None, *, with_meta: bool = False) -> Iterator[Any]:
        """Text as it is produced: of variable `var`, or of the whole state (until everything
        submitted has run). `with_meta`: `(text, meta_info)` pairs of `var` (`TextListener`)."""
        listener = block_on(self._listen(var, with_meta))
        try:
            while delivered(item := listener.items.popleft() if listener.items
                            else block_on(listener.get()), self.raise_error):
                yield item
        finally:
            call_soon(self._listeners.close, listener)

    async def aiter_text(self, var: str | None = None, *,
                         with_meta: bool = False) -> AsyncIterator[Any]:
        """`iter_text` for any event loop (the kernel's included)."""
        listener = await on_loop(self._listen(var, with_meta))
        try:
            while delivered(item := listener.items.popleft() if listener.items
                            else await on_loop(listener.get()), self.raise_error):
                yield item
        finally:
            call_soon(self._listeners.close, listener)

    async def _listen(self, var: str | None, with_meta: bool = False) -> TextListener:
        streaming = self._streaming
        meta = None
        if var is None:
            already, finished = self.text_, False
        elif var in self._finished:  # not a variable a submitted gen writes again
            already, finished = self.variables.get(var, ""), True
            meta = self._final_meta(var)
        elif streaming is not None and streaming[0] == var:
            already, finished = self.text_[streaming[1]:], False
            meta = self._text_meta
        else:
            already, finished = "", False
        return self._listeners.open(var, already if isinstance(already, str) else "",
                                    failed=self.error is not None, finished=finished or self.idle,
                                    with_meta=with_meta, meta=meta)

    def _final_meta(self, name: str) -> dict[str, Any] | None:
        return first_sample_meta(self.meta_info.get(name))

    @property
    def takes_position_ids_offset(self) -> bool:
        """`fork(..., position_ids_offset)` has a taker: an SGLang-style backend's own
        `fork_program` hook (lmnb's runtime offsets no positions)."""
        return takes_position_ids_offset(self.sglang_backend)

    def fork(self, count: int, *,
             position_ids_offset: list[int] | None = None) -> list[StreamExecutor]:
        """New executors that continue from this one's current state (call after `sync`);
        `position_ids_offset` goes to the SGLang-style backend's `fork_program`."""
        branches = []
        for _ in range(count):
            branch = type(self)(self.backend, defaults=self.defaults, stream=self.stream,
                                num_api_spec_tokens=self.num_api_spec_tokens)
            branch.text_ = self.text_
            branch.messages_ = [dict(m) for m in self.messages_]
            branch.variables = dict(self.variables)
            branch._finished = set(self.variables)
            branch.meta_info = dict(self.meta_info)
            branch._role, branch._role_start = self._role, self._role_start
            branch.fork_point = len(self.text_)
            # a branch samples on its own: the parent's speculated continuation is one sample
            branch._spec_turn = self._spec_turn
            branch.spans = list(self.spans)
            branch.media_ = list(self.media_)  # the same prepared items: one hash, one KV span
            branch.turns = list(self.turns)
            branch.observer = self.observer
            branch.token_trace = None if self.token_trace is None else self.token_trace.fork()
            branches.append(branch)
        if self.sglang_backend is not None:
            if position_ids_offset is None:  # an override may not take the argument
                self.sglang_backend.fork_program(self, list(branches))
            else:
                self.sglang_backend.fork_program(self, list(branches), position_ids_offset)
        self._emit("fork", branches=branches)
        return branches

    @property
    def idle(self) -> bool:
        """Nothing submitted is waiting or running."""
        return self._closed or self._done >= self._submitted

    @property
    def alive(self) -> bool:
        """The state still takes or runs expressions (until it is closed and drained)."""
        return not self._closed or self._done < self._submitted

    @property
    def streaming(self) -> tuple[str | None, int] | None:
        """(variable, start in `text_`) of the gen streaming now, or None."""
        return self._streaming

    @property
    def open_role(self) -> tuple[str, int] | None:
        """(role, start of its content in `text_`) of the role begun and not ended, or None."""
        role, start = self._role, self._role_start
        return None if role is None else (role, start)

    def _emit(self, kind: str, **data: Any) -> None:
        observer = self.observer
        if observer is None:
            return
        try:
            observer(kind, self, data)
        except Exception:  # a broken display must not break the program
            logging.getLogger(__name__).exception("program observer failed")

    # ---- loop side -------------------------------------------------------------------------
    async def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._items:
                    self._draining = False
                    break
                item = self._items.popleft()
            await self._run_item(item)
            self._done += 1
            if self._waiters:
                self._wake()
        if self._listeners and self.idle:
            self._listeners.end_all()

    async def _run_item(self, item: Any) -> None:
        if item is _CLOSE:
            if not self._closed:
                self._closed = True
                if self.sglang_backend is not None:
                    end_program(self.sglang_backend, self)
            return
        if self._closed or self.error is not None:
            return
        try:
            if self.cancel.is_set():
                raise ProgramAborted("the program was interrupted")
            await self._run(item)
        except BaseException as error:  # kept and raised to the state's readers
            self._fail(error)

    def _fail(self, error: BaseException) -> None:
        self.error = self.error or error  # the first error is the cause (a body's, then its abort)
        self._listeners.end_all(FAILED)
        self._wake()
        self._emit("error", error=error)

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def _until(self, ready: Callable[[], bool]) -> None:
        while not ready():
            waiter = self._loop.create_future()
            self._waiters.append(waiter)
            await waiter

    def _finish_var(self, name: str) -> None:
        with self._lock:  # final unless a later item (`_done`: the one running) writes it
            if self._last_write.get(name, -1) <= self._done:
                self._finished.add(name)
        if self._listeners:
            self._listeners.finish(name, self._final_meta(name))
        if self._waiters:
            self._wake()
        if self.observer is not None:
            self._emit("variable", name=name)

    def _append(self, text: str, var: str | None = None,
                meta: dict[str, Any] | None = None) -> None:
        """Appends `text`, generated for `var` (None: no variable's) with `meta`, its meta info
        so far."""
        self.text_ += text
        if self._listeners:
            self._listeners.notify(var, text, meta)
        if self.observer is not None:
            self._emit("text", delta=text, var=var)

    def _run(self, expr: Expr) -> Coroutine[Any, Any, None]:
        """`_execute(expr)`, its handler found by one cached lookup."""
        return _dispatcher(type(self))(type(expr))(self, expr)

    @singledispatchmethod
    async def _execute(self, expr: Expr) -> None:
        raise TypeError(f"cannot execute {type(expr).__name__} here")

    @_execute.register
    async def _(self, expr: ExprList) -> None:
        for item in expr.items:
            await self._run(item)

    @_execute.register
    async def _(self, expr: Text) -> None:
        if self.chat and self._role is None and expr.value:
            raise ProgramError(f"a chat model takes messages: text outside a role "
                               f"({expr.value[:40]!r}) cannot be sent; put it in system(), user() "
                               f"or assistant()")
        if self._spec is not None:
            self._spec = self._spec.after_text(expr.value)
        self._append(expr.value)

    @_execute.register
    async def _(self, expr: RoleBegin) -> None:
        self._spec = None
        if self._role is not None:
            raise ProgramError(f"{expr.role!r} begins inside the open {self._role!r} role")
        first = not self.messages_
        self._append(self.backend.chat_template.role_text(expr.role, first=first).prefix)
        self._role, self._role_start = expr.role, len(self.text_)

    @_execute.register
    async def _(self, expr: RoleEnd) -> None:
        if self._role != expr.role:
            raise ProgramError(f"{expr.role!r} ends but the open role is {self._role!r}")
        self._spec = None
        self.messages_.append({"role": expr.role, "content": self.text_[self._role_start:]})
        self.turns.append((expr.role, self._role_start, len(self.text_)))
        self._role = None
        self._append(self.backend.chat_template.role_text(expr.role, first=False).suffix)

    @_execute.register
    async def _(self, expr: Gen) -> None:
        with located(expr.where):
            await self._gen(expr)

    async def _gen(self, expr: Gen) -> None:
        params = merged_over_defaults(expr.params, self.defaults)
        if self._role == "assistant":  # the turn's end stops it too, as in SGLang
            stops, stop_ids = self.backend.chat_template.end_of_turn()
            params = replace(params, stop=(*(params.stop or ()), *stops) or None,
                             stop_token_ids=(*(params.stop_token_ids or ()), *stop_ids) or None)
        start = len(self.text_)
        self._stream_meta = self._text_meta = {}
        if self.num_api_spec_tokens and can_serve(params):
            served = await self._speculated(params)
            if served is not None:
                self._streaming = (expr.name, start)
                self._append(served.text, expr.name, served.meta_info)
                self._finish_gen(expr.name, start, Generation(served.text, served.meta_info),
                                 expr.reasoning)
                return
        self._streaming = (expr.name, start)
        if self._watched:
            generation = await self._call(
                self.text_, params, self._chat_prompt(),
                on_delta=lambda delta: self._stream_delta(expr.name, delta),
                on_meta=self._set_stream_meta)
        else:  # nobody reads the text as it comes: one whole result, no wake-up per token
            generation = await self._call(self.text_, params, self._chat_prompt())
            if isinstance(generation.text, str) and generation.text:
                # as one delta (a late listener's)
                self._append(generation.text, expr.name, first_sample_meta(generation.meta_info))
        self._finish_gen(expr.name, start, generation, expr.reasoning)

    def _set_stream_meta(self, meta: dict[str, Any]) -> None:
        self._stream_meta = meta

    def _stream_delta(self, name: str | None, delta: str) -> None:
        """A running gen's `delta`, with the meta info reported before it (a reader attaching
        later gets the text so far with that, not with a meta info whose text is to come)."""
        self._text_meta = self._stream_meta
        self._append(delta, name, self._text_meta)

    @property
    def _watched(self) -> bool:
        """Someone takes the text as it is generated: a streamed run, an observer (a view), a
        listener (`text_iter`)."""
        return self.stream or self.observer is not None or bool(self._listeners)

    def _chat_prompt(self, *, at_role_start: bool = False) -> ChatPrompt | None:
        if not self.chat:
            return None
        partial = "" if self._role is None or at_role_start else self.text_[self._role_start:]
        return ChatPrompt(tuple(dict(m) for m in self.messages_), self._role, partial)

    def _media_kwargs(self, prompt: str) -> dict[str, Any]:
        """`media=` for a backend call on `prompt` (a prefix of `text_`): the media whose token
        it holds; nothing when it holds none (text-only backends never see the argument)."""
        if not self.media_:
            return {}
        media = tuple(m for start, m in self.media_ if start < len(prompt))
        return {"media": media} if media else {}

    async def _call(self, prompt: str, params: GenParams, chat: ChatPrompt | None,
                    on_delta: Callable[[str], None] | None = None,
                    on_meta: Callable[[dict[str, Any]], None] | None = None) -> Generation:
        """One generate call: awaited on the loop (an `AsyncBackend`), or on a pool thread
        whose streamed deltas (and meta info, `on_meta`) come back to the loop."""
        extra: dict[str, Any] = self._media_kwargs(prompt)
        if chat is not None:
            extra["chat"] = chat
        if self.token_trace is not None:
            extra["trace"] = self.token_trace
        generation = await self._calls.generate(self, prompt, params, cancel=self.cancel,
                                                on_delta=on_delta, on_meta=on_meta, **extra)
        if (message := generation.abort_message()) is not None:
            # The program's own abort (an interrupt, a failed sibling) stays an interruption;
            # the runtime's fails the program: the text is cut short.
            if self.cancel.is_set():
                raise ProgramAborted("the program was interrupted")
            raise ProgramError(f"the runtime aborted the request: {message}")
        return generation

    async def _speculated(self, params: GenParams) -> Served | None:
        """The gen served from speculated text, making the speculative call if none is live;
        None when it needs a real call."""
        spec, self._spec = self._spec, None
        if spec is not None and spec.role == self._role:
            served = spec.serve(params)
            if served is not None:
                self._spec = served.rest
                return served
            if not spec.runs_out(params):
                # It reached this gen and showed it cannot be served (budget, parameters): a
                # new speculative call would not do better than a real one.
                return None
        if not can_start(params):
            return None
        call_params = speculative_params(
            params, self.num_api_spec_tokens or 0,
            token_texts=self.backend.reports_token_texts)
        if self.chat:
            # A chat reply starts at its turn's start: speculate from there and match the
            # turn's text so far as literal text. Once per turn: a retry would repeat itself.
            if self._role != "assistant" or self._spec_turn == self._role_start:
                return None
            self._spec_turn = self._role_start
            generation = await self._call(self.text_[:self._role_start], call_params,
                                          self._chat_prompt(at_role_start=True))
            partial = self.text_[self._role_start:]
        else:
            generation = await self._call(self.text_, call_params, None)
            partial = ""
        if not isinstance(generation.text, str) or not isinstance(generation.meta_info, dict):
            return None
        spec = Speculation.from_call(generation.text, generation.meta_info, call_params,
                                     self._role)
        spec = spec.after_text(partial) if spec is not None else None
        served = spec.serve(params) if spec is not None else None
        if served is None:
            return None
        self._spec = served.rest
        return served

    def _finish_gen(self, name: str | None, start: int, generation: Generation,
                    reasoning: str | None = None) -> None:
        text = generation.text
        if reasoning is not None:  # separate_reasoning: the state keeps the answer only
            text, thought = split_reasoning(text, reasoning)
            self.variables[reasoning_name(name)] = thought
        first = text[0] if isinstance(text, list) else text
        # The final text replaces what was streamed.
        streamed = self.text_[start:]
        if first != streamed:
            self.text_ = self.text_[:start] + first
        self._streaming = None
        self._stream_meta = self._text_meta = {}
        if first.startswith(streamed) and len(first) > len(streamed) and self._listeners:
            self._listeners.notify(name, first[len(streamed):],
                                   first_sample_meta(generation.meta_info))
        if name is not None:
            self.spans.append((name, start, len(self.text_)))
            self.variables[name] = text
            self.meta_info[name] = generation.meta_info
        if reasoning is not None:
            self._finish_var(reasoning_name(name))
        if name is not None:
            self._finish_var(name)

    @_execute.register
    async def _(self, expr: Select) -> None:
        self._spec = None
        with located(expr.where):
            choice, meta = await self._calls.select(self, self.text_, expr.choices, expr.method,
                                                    **self._media_kwargs(self.text_))
        if expr.reasoning is not None:
            choice, thought = split_reasoning(choice, expr.reasoning)
            self.variables[reasoning_name(expr.name)] = thought
            self._finish_var(reasoning_name(expr.name))
        start = len(self.text_)
        self._append(choice, expr.name, meta)
        if expr.name is not None:
            self.spans.append((expr.name, start, len(self.text_)))
            self.variables[expr.name] = choice
            self.meta_info[expr.name] = meta
            self._finish_var(expr.name)

    @_execute.register
    async def _(self, expr: VarScopeBegin) -> None:
        self._scopes[expr.name] = len(self.text_)

    @_execute.register
    async def _(self, expr: VarScopeEnd) -> None:
        if expr.name not in self._scopes:
            raise ProgramError(f"var_scope {expr.name!r} ends without beginning")
        self.variables[expr.name] = self.text_[self._scopes.pop(expr.name):]
        self._finish_var(expr.name)

    @_execute.register
    async def _(self, expr: SetVar) -> None:
        self.variables[expr.name] = expr.value
        self._finish_var(expr.name)

    @_execute.register
    async def _(self, expr: CommitPrefix) -> None:
        await self._calls.cache_prefix(self, self.text_, **self._media_kwargs(self.text_))

    @_execute.register
    async def _(self, expr: Image) -> None:
        await self._add_media("image", expr.source, None)

    @_execute.register
    async def _(self, expr: Video) -> None:
        await self._add_media("video", expr.source, expr.num_frames)

    async def _add_media(self, kind: str, source: Any, num_frames: int | None) -> None:
        """Prepares the media once (forks share it; on a pool thread: loading and preprocessing
        take time) and writes its token where it goes: the chat template's form inside a role
        (llava-hf's "<image>\\n"), else the bare token."""
        try:
            media = await in_thread(self.backend.prepare_media, kind, source,
                                    num_frames=num_frames)
        except MediaUnsupported as error:
            raise ProgramError(f"{kind}() needs a multimodal (LLaVA) backend: {error}") from None
        self._spec = None
        text = media.token
        if self._role is not None:
            text = self.backend.chat_template.media_text(kind, media.token)
        self.media_.append((len(self.text_) + text.index(media.token), media))
        self._append(text)

    @_execute.register
    async def _(self, expr: JoinBranches) -> None:
        self._spec = None
        for branch in expr.branches:
            await branch.drained()
            if branch.error is not None:  # the join fails: the other branches' gens stop too
                for other in expr.branches:
                    other.abort()
                branch.raise_error()
        if expr.mode == "gather_variable":
            # As SGLang: a variable the parent has already is kept as it is; the others list
            # the values of the branches that set them, in branch order (no None for the rest).
            names = {name for branch in expr.branches for name in branch.variables
                     if name not in self.variables}
            for name in sorted(names):
                self.variables[name] = [branch.variables[name] for branch in expr.branches
                                        if name in branch.variables]
                self._finish_var(name)
        elif expr.mode == "concat_and_append":
            for branch in expr.branches:
                shift = len(self.text_) - branch.fork_point
                self.media_.extend((start + shift, media) for start, media in branch.media_
                                   if start >= branch.fork_point)
                self._append(branch.text_[branch.fork_point:])
        else:
            raise ProgramError(f"unknown join mode {expr.mode!r}; use gather_variable or "
                               f"concat_and_append")
