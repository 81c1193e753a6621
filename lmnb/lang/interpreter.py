"""`StreamExecutor`: runs one program state's expressions, in order, on a worker thread.

`submit` never blocks; readers (`get_var`, `text`) wait for what they need. The first error stops
the stream, is kept, and is raised to every later reader.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import singledispatchmethod
from typing import TYPE_CHECKING, Any

from lmnb.lang.backends.base import (
    Backend,
    BaseBackend,
    CancelEvent,
    ChatPrompt,
    Generation,
    MediaInput,
    MediaUnsupported,
    ProgramAborted,
    end_program,
    sglang_generate,
    sglang_select,
)
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
    SourceLocation,
    Text,
    VarScopeBegin,
    VarScopeEnd,
    Video,
)
from lmnb.lang.reasoning import reasoning_name, split_reasoning
from lmnb.lang.speculation import Served, Speculation, can_serve, can_start, speculative_params

if TYPE_CHECKING:
    from lmnb.lang.token_trace import TokenTrace

_POLL = 0.05  # seconds between checks while waiting, so that Ctrl-C gets through
_IDLE_POLL = 0.5  # the same off the main thread, where no KeyboardInterrupt lands


def poll_interval() -> float:
    """How long a wait may block between checks: short on the main thread (a simulated Ctrl-C,
    `_thread.interrupt_main()`, does not wake a blocked lock), longer on others (hundreds of
    program threads waking 20 times a second cost the host real time)."""
    return _POLL if threading.current_thread() is threading.main_thread() else _IDLE_POLL


class ProgramError(RuntimeError):
    """An error raised inside a program, re-raised where its result is read."""


@contextmanager
def located(where: SourceLocation | None) -> Iterator[None]:
    """An error raised inside records `where` (the program line of the gen or select that was
    running) as `error.lmnb_where`, unless it has one already: the worker thread's traceback
    does not reach the program's code."""
    try:
        yield
    except BaseException as error:
        if where is not None and getattr(error, "lmnb_where", None) is None:
            try:
                error.lmnb_where = where  # type: ignore[attr-defined]
            except AttributeError:  # an exception type without a __dict__
                pass
        raise


@dataclass(frozen=True)
class JoinBranches(Expr):
    """Interpreter-only node: merge forked executors back into this one."""

    branches: tuple[StreamExecutor, ...]
    mode: str


_END = object()
_executor_ids = itertools.count()

# observer(kind, executor, data): kind is "text" (data: delta, var), "variable" (name), "fork"
# (branches), or "error" (error). Called on the executor's worker thread; must not block.
Observer = Callable[[str, "StreamExecutor", dict[str, Any]], None]


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
        self.chat = bool(getattr(backend, "is_chat_model", False))
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
        self._closed = False
        self.cancel = CancelEvent()
        self._role: str | None = None
        self._role_start = 0
        self._streaming: tuple[str | None, int] | None = None  # (variable, start) of a running gen
        self._scopes: dict[str, int] = {}
        self._spec: Speculation | None = None  # API speculation: what the model should write next
        self._spec_turn: int | None = None  # chat: the turn (its start) speculated already
        self._var_events: dict[str, threading.Event] = defaultdict(threading.Event)
        self._listeners: list[tuple[str | None, queue.SimpleQueue]] = []
        self._listeners_lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        # A custom backend in SGLang's shape gets its hooks called with this executor.
        self.sglang_backend = backend if isinstance(backend, BaseBackend) else None
        if self.sglang_backend is not None:
            self.sglang_backend.begin_program(self)
        self._worker = threading.Thread(target=self._run, name="lmnb-program", daemon=True)
        self._worker.start()

    # ---- caller side -----------------------------------------------------------------------
    def submit(self, expr: Expr) -> None:
        if self._closed:
            raise ProgramError("this program state is closed")
        self._queue.put(expr)

    def sync(self) -> None:
        """Waits until everything submitted so far has run."""
        if not self.alive:
            return
        done = threading.Event()
        self._queue.put(done)
        poll = poll_interval()
        while not done.wait(poll):
            if not self.alive:
                return

    def close(self) -> None:
        """Stops the worker once its queue is drained."""
        self._queue.put(_END)

    def abort(self) -> None:
        """Interrupts the running request (freeing its KV) and drops what is queued."""
        self.cancel.set()

    def raise_error(self) -> None:
        if self.error is not None:
            raise ProgramError(f"the program failed: {self.error!r}") from self.error

    def get_var(self, name: str) -> Any:
        event = self._var_events[name]
        while not event.wait(_POLL):
            if self.error is not None:
                break
            if not self._queue.unfinished_tasks and not event.is_set():
                if name in self.variables:
                    break
                raise KeyError(f"the program set no variable {name!r}")
        self.raise_error()
        return self.variables[name]

    def text(self) -> str:
        self.sync()
        self.raise_error()
        return self.text_

    def iter_text(self, var: str | None = None) -> Iterator[str]:
        """Text as it is produced: of variable `var`, or of the whole state."""
        events: queue.SimpleQueue = queue.SimpleQueue()
        with self._listeners_lock:
            streaming = self._streaming
            if var is None:
                already, finished = self.text_, False
            elif var in self.variables:
                already, finished = self.variables[var], True
            elif streaming is not None and streaming[0] == var:
                already, finished = self.text_[streaming[1]:], False
            else:
                already, finished = "", False
            self._listeners.append((var, events))
        try:
            if isinstance(already, str) and already:
                yield already
            if finished:
                return
            while True:
                try:
                    item = events.get(timeout=_POLL)
                except queue.Empty:
                    if self.error is not None:
                        self.raise_error()
                    if not self._queue.unfinished_tasks:  # all done: hand out what is left
                        while not events.empty():
                            item = events.get()
                            if item is _END:
                                return
                            yield item
                        return
                    continue
                if item is _END:
                    return
                yield item
        finally:
            with self._listeners_lock:
                self._listeners.remove((var, events))

    def fork(self, count: int) -> list[StreamExecutor]:
        """New executors that continue from this one's current state (call after `sync`)."""
        branches = []
        for _ in range(count):
            branch = type(self)(self.backend, defaults=self.defaults, stream=self.stream,
                                num_api_spec_tokens=self.num_api_spec_tokens)
            branch.text_ = self.text_
            branch.messages_ = [dict(m) for m in self.messages_]
            branch.variables = dict(self.variables)
            for name in branch.variables:
                branch._var_events[name].set()
            branch.meta_info = dict(self.meta_info)
            branch._role, branch._role_start = self._role, self._role_start
            branch.fork_point = len(self.text_)
            branch._spec, branch._spec_turn = self._spec, self._spec_turn
            branch.spans = list(self.spans)
            branch.media_ = list(self.media_)  # the same prepared items: one hash, one KV span
            branch.turns = list(self.turns)
            branch.observer = self.observer
            branch.token_trace = None if self.token_trace is None else self.token_trace.fork()
            branches.append(branch)
        if self.sglang_backend is not None:
            self.sglang_backend.fork_program(self, list(branches))
        self._emit("fork", branches=branches)
        return branches

    @property
    def idle(self) -> bool:
        """Nothing submitted is waiting or running."""
        return self._closed or not self._queue.unfinished_tasks

    @property
    def alive(self) -> bool:
        """The worker thread still runs (it stops once closed and drained)."""
        return self._worker.is_alive()

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

    def _drain_after_close(self) -> None:
        """Settles what arrives after the end marker (sync markers of late readers)."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, threading.Event):
                item.set()
            self._queue.task_done()

    # ---- worker side -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            expr = self._queue.get()
            try:
                if expr is _END:
                    self._closed = True
                    self._drain_after_close()
                    if self.sglang_backend is not None:
                        end_program(self.sglang_backend, self)
                    return
                if isinstance(expr, threading.Event):
                    expr.set()
                elif self.error is None:
                    if self.cancel.is_set():
                        raise ProgramAborted("the program was interrupted")
                    self._execute(expr)
            except BaseException as error:
                self.error = error
                for event in list(self._var_events.values()):
                    event.set()
                self._emit("error", error=error)
            finally:
                self._queue.task_done()

    def _notify(self, var: str | None, delta: str) -> None:
        for wanted, events in self._listeners:  # callers hold _listeners_lock
            if wanted is None or wanted == var:
                events.put(delta)

    def _finish_var(self, name: str) -> None:
        with self._listeners_lock:
            for wanted, events in self._listeners:
                if wanted == name:
                    events.put(_END)
        self._var_events[name].set()
        self._emit("variable", name=name)

    def _append(self, text: str, var: str | None = None) -> None:
        with self._listeners_lock:  # listeners joining now see the text in `text_` or as a delta
            self.text_ += text
            self._notify(var, text)
        self._emit("text", delta=text, var=var)

    @singledispatchmethod
    def _execute(self, expr: Expr) -> None:
        raise TypeError(f"cannot execute {type(expr).__name__} here")

    @_execute.register
    def _(self, expr: ExprList) -> None:
        for item in expr.items:
            self._execute(item)

    @_execute.register
    def _(self, expr: Text) -> None:
        if self.chat and self._role is None and expr.value:
            raise ProgramError(f"a chat model takes messages: text outside a role "
                               f"({expr.value[:40]!r}) cannot be sent; put it in system(), user() "
                               f"or assistant()")
        if self._spec is not None:
            self._spec = self._spec.after_text(expr.value)
        self._append(expr.value)

    @_execute.register
    def _(self, expr: RoleBegin) -> None:
        self._spec = None
        if self._role is not None:
            raise ProgramError(f"{expr.role!r} begins inside the open {self._role!r} role")
        first = not self.messages_
        self._append(self.backend.chat_template.role_text(expr.role, first=first).prefix)
        self._role, self._role_start = expr.role, len(self.text_)

    @_execute.register
    def _(self, expr: RoleEnd) -> None:
        if self._role != expr.role:
            raise ProgramError(f"{expr.role!r} ends but the open role is {self._role!r}")
        self._spec = None
        self.messages_.append({"role": expr.role, "content": self.text_[self._role_start:]})
        self.turns.append((expr.role, self._role_start, len(self.text_)))
        self._role = None
        self._append(self.backend.chat_template.role_text(expr.role, first=False).suffix)

    @_execute.register
    def _(self, expr: Gen) -> None:
        with located(expr.where):
            self._gen(expr)

    def _gen(self, expr: Gen) -> None:
        params = expr.params.merged_over(self.defaults)
        if self._role == "assistant":  # the turn's end stops it too, as in SGLang
            stops, stop_ids = self.backend.chat_template.end_of_turn()
            params = replace(params, stop=(*(params.stop or ()), *stops) or None,
                             stop_token_ids=(*(params.stop_token_ids or ()), *stop_ids) or None)
        start = len(self.text_)
        if self.num_api_spec_tokens and can_serve(params):
            served = self._speculated(params)
            if served is not None:
                self._streaming = (expr.name, start)
                self._append(served.text, expr.name)
                self._finish_gen(expr.name, start, Generation(served.text, served.meta_info),
                                 expr.reasoning)
                return
        self._streaming = (expr.name, start)
        generation = self._call(self.text_, params, self._chat_prompt(),
                                on_delta=lambda delta: self._append(delta, expr.name))
        self._finish_gen(expr.name, start, generation, expr.reasoning)

    def _chat_prompt(self, *, at_role_start: bool = False) -> ChatPrompt | None:
        if not self.chat:
            return None
        partial = "" if self._role is None or at_role_start else self.text_[self._role_start:]
        return ChatPrompt(tuple(dict(m) for m in self.messages_), self._role, partial)

    def _media_kwargs(self, prompt: str) -> dict[str, Any]:
        """`media=` for a backend call on `prompt` (a prefix of `text_`): the media whose token
        it holds; nothing when it holds none (text-only backends never see the argument)."""
        media = tuple(m for start, m in self.media_ if start < len(prompt))
        return {"media": media} if media else {}

    def _call(self, prompt: str, params: GenParams, chat: ChatPrompt | None,
              on_delta: Callable[[str], None] | None = None) -> Generation:
        if self.sglang_backend is not None:  # its hooks read the prompt from this executor
            return sglang_generate(self.sglang_backend, self, params, on_delta=on_delta,
                                   cancel=self.cancel)
        extra: dict[str, Any] = self._media_kwargs(prompt)
        if chat is not None:
            extra["chat"] = chat
        if self.token_trace is not None:
            extra["trace"] = self.token_trace
        return self.backend.generate(prompt, params, on_delta=on_delta, cancel=self.cancel,
                                     **extra)

    def _speculated(self, params: GenParams) -> Served | None:
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
            token_texts=bool(getattr(self.backend, "reports_token_texts", False)))
        if self.chat:
            # A chat reply starts at its turn's start: speculate from there and match the
            # turn's text so far as literal text. Once per turn: a retry would repeat itself.
            if self._role != "assistant" or self._spec_turn == self._role_start:
                return None
            self._spec_turn = self._role_start
            generation = self._call(self.text_[:self._role_start], call_params,
                                    self._chat_prompt(at_role_start=True))
            partial = self.text_[self._role_start:]
        else:
            generation = self._call(self.text_, call_params, None)
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
        with self._listeners_lock:  # the final text replaces what was streamed
            streamed = self.text_[start:]
            self.text_ = self.text_[:start] + first
            self._streaming = None
            if first.startswith(streamed) and len(first) > len(streamed):
                self._notify(name, first[len(streamed):])
            if name is not None:
                self.spans.append((name, start, len(self.text_)))
                self.variables[name] = text
                self.meta_info[name] = generation.meta_info
        if reasoning is not None:
            self._finish_var(reasoning_name(name))
        if name is not None:
            self._finish_var(name)

    @_execute.register
    def _(self, expr: Select) -> None:
        self._spec = None
        with located(expr.where):
            if self.sglang_backend is not None:
                choice, meta = sglang_select(self.sglang_backend, self, expr.choices,
                                             expr.method)
            else:
                choice, meta = self.backend.select(self.text_, expr.choices, expr.method,
                                                   **self._media_kwargs(self.text_))
        if expr.reasoning is not None:
            choice, thought = split_reasoning(choice, expr.reasoning)
            self.variables[reasoning_name(expr.name)] = thought
            self._finish_var(reasoning_name(expr.name))
        start = len(self.text_)
        self._append(choice, expr.name)
        if expr.name is not None:
            self.spans.append((expr.name, start, len(self.text_)))
            self.variables[expr.name] = choice
            self.meta_info[expr.name] = meta
            self._finish_var(expr.name)

    @_execute.register
    def _(self, expr: VarScopeBegin) -> None:
        self._scopes[expr.name] = len(self.text_)

    @_execute.register
    def _(self, expr: VarScopeEnd) -> None:
        if expr.name not in self._scopes:
            raise ProgramError(f"var_scope {expr.name!r} ends without beginning")
        self.variables[expr.name] = self.text_[self._scopes.pop(expr.name):]
        self._finish_var(expr.name)

    @_execute.register
    def _(self, expr: SetVar) -> None:
        self.variables[expr.name] = expr.value
        self._finish_var(expr.name)

    @_execute.register
    def _(self, expr: CommitPrefix) -> None:
        if self.sglang_backend is not None:
            self.sglang_backend.commit_lazy_operations(self)
        else:
            self.backend.cache_prefix(self.text_, **self._media_kwargs(self.text_))

    @_execute.register
    def _(self, expr: Image) -> None:
        self._add_media("image", expr.source, None)

    @_execute.register
    def _(self, expr: Video) -> None:
        self._add_media("video", expr.source, expr.num_frames)

    def _add_media(self, kind: str, source: Any, num_frames: int | None) -> None:
        """Prepares the media once (forks share it) and writes its token where it goes: the
        chat template's form inside a role (llava-hf's "<image>\\n"), else the bare token."""
        prepare = getattr(self.backend, "prepare_media", None)
        try:
            if prepare is None:
                raise MediaUnsupported(f"{type(self.backend).__name__} is text-only")
            media = prepare(kind, source, num_frames=num_frames)
        except MediaUnsupported as error:
            raise ProgramError(f"{kind}() needs a multimodal (LLaVA) backend: {error}") from None
        self._spec = None
        text = media.token
        if self._role is not None:
            text = self.backend.chat_template.media_text(kind, media.token)
        self.media_.append((len(self.text_) + text.index(media.token), media))
        self._append(text)

    @_execute.register
    def _(self, expr: JoinBranches) -> None:
        self._spec = None
        for branch in expr.branches:
            branch.sync()
            branch.raise_error()
        if expr.mode == "gather_variable":
            # As SGLang: a variable the parent has already is kept as it is.
            names = {name for branch in expr.branches for name in branch.variables
                     if name not in self.variables}
            for name in sorted(names):
                self.variables[name] = [branch.variables.get(name) for branch in expr.branches]
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

