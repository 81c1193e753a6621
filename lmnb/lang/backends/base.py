"""The protocol every backend implements, and the results it returns; and `BaseBackend`, SGLang's
base class of custom backends, whose hooks the interpreter calls with the program's executor."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from lmnb.lang.chat_template import ChatTemplate
from lmnb.lang.choices import ChoicesMethod
from lmnb.lang.ir import GenParams
from lmnb.lang.program_error import runtime_abort_message


class CancelEvent(threading.Event):
    """The `cancel=` a program's executor passes its backend: an Event that also runs callbacks
    when set, so that a backend blocked on a stream wakes at once instead of polling the flag."""

    def __init__(self) -> None:
        super().__init__()
        self._callbacks: list[Callable[[], None]] = []
        self._callbacks_lock = threading.Lock()

    def set(self) -> None:
        with self._callbacks_lock:
            callbacks, self._callbacks = self._callbacks, []
            super().set()
        for callback in callbacks:
            callback()

    def on_set(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Runs `callback` when the event is set (now, if it is); returns its removal."""
        with self._callbacks_lock:
            if not self.is_set():
                self._callbacks.append(callback)
                return lambda: self._remove(callback)
        callback()
        return lambda: None

    def _remove(self, callback: Callable[[], None]) -> None:
        with self._callbacks_lock:
            if callback in self._callbacks:
                self._callbacks.remove(callback)


class ProgramAborted(RuntimeError):
    """The program was interrupted; its requests were aborted."""


class MediaUnsupported(RuntimeError):
    """The backend's model takes no images (or no videos)."""


MEDIA_KINDS = ("image", "video")


@dataclass(frozen=True)
class MediaInput:
    """One image or video of a program's prompt, as its backend prepared it (once: forks and
    later gens reuse it).

    `token` is the text standing for it in the prompt (the model's image or video token, e.g.
    `<image>`); `data` is what the backend sends (a preprocessed `MediaItem`, a data URL, ...)."""

    kind: str  # "image" | "video"
    token: str
    data: Any


def media_data(media: Sequence[MediaInput]) -> dict[str, list[Any]]:
    """`image_data=` / `video_data=` of one prompt's media (each kind in prompt order), as
    `Runtime.generate` and SGLang's `/generate` take them."""
    data: dict[str, list[Any]] = {}
    for item in media:
        data.setdefault(f"{item.kind}_data", []).append(item.data)
    return data


@dataclass
class Generation:
    text: str | list[str]  # a list when n > 1
    meta_info: dict[str, Any] | list[dict[str, Any]] = field(default_factory=dict)

    def abort_message(self) -> str | None:
        """Why the backend's runtime aborted a sample (its finish reason is `{"type": "abort",
        "message": ...}`: out of KV cache, a failed step, a closed runtime), else None."""
        metas = self.meta_info if isinstance(self.meta_info, list) else [self.meta_info]
        return next(filter(None, map(runtime_abort_message, metas)), None)


@dataclass(frozen=True)
class ChatPrompt:
    """The program's conversation at a `gen`, for backends whose endpoint takes messages.

    `messages` are the closed role messages; `role` is the open one (None outside roles) and
    `partial` its content written so far (text the reply must continue)."""

    messages: tuple[dict[str, str], ...]
    role: str | None
    partial: str = ""


@runtime_checkable
class Backend(Protocol):
    """What the interpreter calls for a program's gens and selects. `LocalBackend` (a `Runtime`
    in this process), `RuntimeEndpoint` (a server's SGLang-native API) and `OpenAI` (an
    OpenAI-compatible endpoint) implement it; SGLang-style custom backends subclass `BaseBackend`
    instead. Implementations may take more keyword arguments, each with a default (`media=` once
    `prepare_media` has prepared some, `chat=` when `is_chat_model`)."""

    # Role text from the model's own template; a backend over a Runtime renders it with
    # `Runtime.apply_chat_template`, so roles and chat prompts agree.
    chat_template: ChatTemplate
    # The endpoint takes messages: `generate` is also given `chat=ChatPrompt(...)`.
    is_chat_model: bool
    # `meta_info["output_token_logprobs"]` entries carry token texts, `(logprob, id, text)`,
    # which API speculation uses to size each served gen.
    reports_token_texts: bool

    def generate(self, prompt: str, params: GenParams, *,
                 on_delta: Callable[[str], None] | None = None,
                 cancel: threading.Event | None = None) -> Generation:
        """Continues `prompt`. `on_delta` receives text as it streams; setting `cancel` aborts
        the request and raises `ProgramAborted`. Backends of chat models (`is_chat_model` true)
        are also given `chat=ChatPrompt(...)`, the same prompt as messages.

        `meta_info` carries at least `finish_reason` (`{"type": "stop" | "length", ...}`) and
        `completion_tokens` when the backend knows them (API speculation relies on both). A
        backend that streams its meta info too takes `on_meta=` (`MetaInfoStreaming`)."""
        ...

    def select(self, prompt: str, choices: tuple[str, ...], method: str) -> tuple[str, dict]:
        """The chosen continuation and its scores."""
        ...

    def cache_prefix(self, prompt: str) -> None:
        """Hint: `prompt` will be shared by several continuations."""
        ...

    def prepare_media(self, kind: str, source: Any, *,
                      num_frames: int | None = None) -> MediaInput:
        """Loads (and hashes, preprocesses) one image or video for this backend's model; raises
        `MediaUnsupported` when the model (or the backend) takes no such media, `ValueError`
        for bad media. Then `generate`, `select` and `cache_prefix` are also given `media=` (a
        sequence of `MediaInput`, in prompt order) when the prompt has media; every media's
        `token` is in the prompt text where it goes."""
        ...


@runtime_checkable
class MetaInfoStreaming(Protocol):
    """A backend whose streamed gens report their meta info as it grows (`LocalBackend`,
    `RuntimeEndpoint`): with `streams_meta_info` true, its `generate` (and `agenerate`) also
    take `on_meta=`, called with the gen's meta info so far (`prompt_tokens`,
    `completion_tokens`, `finish_reason` once it ends, ...) before the `on_delta` of the text
    that came with it. `ProgramState.text_iter(name, return_meta_data=True)` yields them."""

    streams_meta_info: bool


def streams_meta_info(backend: object) -> bool:
    """Whether `backend`'s `generate` takes `on_meta=` (`MetaInfoStreaming`)."""
    return isinstance(backend, MetaInfoStreaming) and backend.streams_meta_info is True


@runtime_checkable
class PrefixPinning(Protocol):
    """A backend that keeps a prefix cached until it is unpinned (`Program.pin`; `LocalBackend`
    over a `Runtime`)."""

    def pin_prefix(self, prompt: str) -> int: ...

    def unpin_prefix(self, pin: int) -> bool: ...


@runtime_checkable
class CacheFlushing(Protocol):
    """A backend that empties its runtime's prefix cache (`lmnb.flush_cache()`)."""

    def flush_cache(self) -> bool: ...


@runtime_checkable
class ServerInfoSource(Protocol):
    """A backend that reports its runtime's settings and statistics (`lmnb.get_server_info()`)."""

    def get_server_info(self) -> dict[str, Any]: ...


# ---- SGLang's custom backends --------------------------------------------------------------------
class ProgramExecutor(Protocol):
    """What an SGLang-style backend hook reads of its `s` (the program's `StreamExecutor`, whose
    fields have SGLang's names): the text so far, the closed messages, the variables and their
    meta info, and whether the program streams."""

    text_: str
    messages_: list[dict[str, str]]
    variables: dict[str, Any]
    meta_info: dict[str, Any]
    stream: bool


@dataclass
class ChoicesDecision:
    """What `BaseBackend.select` returns (SGLang's `ChoicesDecision`)."""

    decision: str
    meta_info: dict[str, Any] | None = None


@dataclass
class SglSamplingParams:
    """One gen's sampling parameters as SGLang hands them to a backend (the fields and defaults
    of `sglang.lang.ir.SglSamplingParams`), plus lmnb's `seed`. `dtype` is always None: lmnb
    turns `gen(dtype=...)` into `regex` (and stops) when the program is written."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    n: int = 1
    stop: str | list[str] | tuple[()] = ()
    stop_token_ids: list[int] | tuple[()] | None = ()
    stop_regex: str | list[str] | tuple[()] | None = ()
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    ignore_eos: bool = False
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    json_schema: str | None = None
    dtype: str | None = None
    regex: str | None = None
    seed: int | None = None

    @classmethod
    def from_gen_params(cls, params: GenParams) -> SglSamplingParams:
        """`params`' set values (tuples as lists); the unset ones keep SGLang's defaults."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: list(v) if isinstance(v, tuple) else v
                  for k, v in params.set_values().items() if k in names}
        return cls(**values)

    def clone(self) -> SglSamplingParams:
        return dataclasses.replace(self, **{
            f.name: list(getattr(self, f.name)) for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), list)})

    def to_srt_kwargs(self) -> dict[str, Any]:
        """The `sampling_params` of a `/generate` request (SGLang's names; the seed as
        `sampling_seed` when set)."""
        out = {name: getattr(self, name) for name in (
            "max_new_tokens", "min_new_tokens", "n", "stop", "stop_token_ids", "stop_regex",
            "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
            "ignore_eos", "regex", "json_schema")}
        if self.seed is not None:
            out["sampling_seed"] = self.seed
        return out


class BaseBackend:
    """SGLang's base class of custom backends (`sglang.lang.backend.base_backend.BaseBackend`):
    the same hooks, names and signatures. Subclass it and implement `generate` (and
    `generate_stream` for streamed programs), `select`, and what else the backend needs;
    `lmnb.set_default_backend(MyBackend())` or `program.run(backend=MyBackend())` runs programs
    on it.

    lmnb's interpreter calls, with `s` the program's executor (`ProgramExecutor`):
    `generate(s, sampling_params)` -> `(text, meta_info)` for each gen (`text` a list when
    `n > 1`); `generate_stream(s, sampling_params)` -> iterable of `(text_piece, meta_info)`
    instead when the program runs with `stream=True` and the subclass has it;
    `select(s, choices, temperature, choices_method)` -> `ChoicesDecision`;
    `commit_lazy_operations(s)` before a fork into several branches; `cache_prefix(prefix)`
    before `run_batch` runs the programs; `begin_program(s)` when an executor starts (the
    program's and each branch's), `fork_program(src, dst)` at a fork, `end_program(s)` when an
    executor ends. `get_chat_template()` gives the role text (`lmnb.lang.chat_template`'s
    `ChatTemplate`; plain "User: " ... by default). Images and videos are not passed.
    """

    is_chat_model = False  # a subclass over a chat endpoint sets it: gens get role messages
    reports_token_texts = False

    def __init__(self) -> None:
        self.support_concate_and_append = False
        self._chat_template = ChatTemplate(None)

    # The interpreter reads `backend.chat_template`: it is `get_chat_template()`'s.
    @property
    def chat_template(self) -> ChatTemplate:
        return self.get_chat_template()

    @chat_template.setter
    def chat_template(self, template: ChatTemplate) -> None:
        self._chat_template = template

    def get_model_name(self) -> str:
        raise NotImplementedError()

    def get_chat_template(self) -> ChatTemplate:
        return self._chat_template

    def cache_prefix(self, prefix_str: str) -> None:
        pass

    def uncache_prefix(self, rid: str) -> None:
        pass

    def end_request(self, rid: str | list[str]) -> None:
        pass

    def begin_program(self, s: ProgramExecutor) -> None:
        pass

    def end_program(self, s: ProgramExecutor | list[ProgramExecutor]) -> None:
        pass

    def commit_lazy_operations(self, s: ProgramExecutor) -> None:
        pass

    def fork_program(self, src: ProgramExecutor, dst: list[ProgramExecutor],
                     position_ids_offset: list[int] | None = None) -> None:
        pass

    def fill_image(self, s: ProgramExecutor) -> None:
        pass

    def generate(self, s: ProgramExecutor,
                 sampling_params: SglSamplingParams) -> tuple[str | list[str], dict[str, Any]]:
        raise NotImplementedError()

    def generate_stream(self, s: ProgramExecutor, sampling_params: SglSamplingParams
                        ) -> Iterable[tuple[str, dict[str, Any]]]:
        raise NotImplementedError()

    def select(self, s: ProgramExecutor, choices: list[str], temperature: float,
               choices_method: ChoicesMethod | None = None) -> ChoicesDecision:
        raise NotImplementedError()

    def prepare_media(self, kind: str, source: Any, *,
                      num_frames: int | None = None) -> MediaInput:
        """`Backend.prepare_media`: SGLang's hooks pass no images or videos."""
        raise MediaUnsupported(f"{type(self).__name__} (an SGLang-style custom backend) takes no "
                               f"{kind}s")

    def concatenate_and_append(self, src_rids: list[str], dst_rid: str) -> None:
        raise NotImplementedError()

    def shutdown(self) -> None:
        pass

    def flush_cache(self) -> Any:
        pass

    def get_server_info(self) -> Any:
        pass


def _streams(backend: BaseBackend) -> bool:
    return type(backend).generate_stream is not BaseBackend.generate_stream


def takes_position_ids_offset(backend: BaseBackend | None) -> bool:
    """Whether `backend` is an SGLang-style one whose `fork_program` hook is its own (it is given
    `fork(size, position_ids_offset)`'s offsets): lmnb's runtime offsets no positions."""
    return backend is not None and type(backend).fork_program is not BaseBackend.fork_program


def sglang_generate(backend: BaseBackend, s: ProgramExecutor, params: GenParams, *,
                    on_delta: Callable[[str], None] | None = None,
                    on_meta: Callable[[dict[str, Any]], None] | None = None,
                    cancel: threading.Event | None = None) -> Generation:
    """One gen on an SGLang-style backend: `generate_stream` when the program streams and the
    backend has it (each piece goes to `on_delta`, after its meta info to `on_meta`), else
    `generate`."""
    sampling_params = SglSamplingParams.from_gen_params(params)
    name = type(backend).__name__
    if s.stream and _streams(backend):
        text, meta = "", {}
        pieces = iter(backend.generate_stream(s, sampling_params))
        try:
            for item in pieces:
                if cancel is not None and cancel.is_set():
                    raise ProgramAborted("the program was interrupted")
                piece, meta = _pair(item, f"{name}.generate_stream")
                text += piece
                if on_meta is not None and isinstance(meta, dict):
                    on_meta(dict(meta))
                if on_delta is not None and piece:
                    on_delta(piece)
        finally:
            if isinstance(pieces, Generator):  # stops at its current yield
                pieces.close()
        return Generation(text, dict(meta or {}))
    text, meta = _pair(backend.generate(s, sampling_params), f"{name}.generate")
    if cancel is not None and cancel.is_set():
        raise ProgramAborted("the program was interrupted")
    if isinstance(text, list) and not isinstance(meta, list):  # n samples, one meta_info
        meta = [dict(meta or {}) for _ in text]
    return Generation(text, meta if isinstance(meta, list) else dict(meta or {}))


def _pair(item: Any, call: str) -> tuple[Any, Any]:
    if not isinstance(item, tuple) or len(item) != 2:
        raise TypeError(f"{call} must return (text, meta_info), got {type(item).__name__}")
    text, meta = item
    if not (isinstance(text, str) or (isinstance(text, list)
                                      and all(isinstance(t, str) for t in text))):
        raise TypeError(f"{call} must return text as a str (a list of str for n > 1), got "
                        f"{type(text).__name__}")
    return text, meta


def sglang_select(backend: BaseBackend, s: ProgramExecutor, choices: Sequence[str],
                  method: str) -> tuple[str, dict[str, Any]]:
    """One select on an SGLang-style backend (temperature 0, as SGLang's `select` default)."""
    decision = backend.select(s, list(choices), 0.0, ChoicesMethod(method))
    if not isinstance(decision, ChoicesDecision):
        raise TypeError(f"{type(backend).__name__}.select must return a ChoicesDecision, got "
                        f"{type(decision).__name__}")
    if decision.decision not in choices:
        raise ValueError(f"{type(backend).__name__}.select chose {decision.decision!r}, which "
                         f"is not one of {list(choices)}")
    return decision.decision, dict(decision.meta_info or {})


def end_program(backend: BaseBackend, s: ProgramExecutor) -> None:
    """`backend.end_program(s)`, its failure logged: the executor is ending anyway."""
    try:
        backend.end_program(s)
    except Exception:
        logging.getLogger(__name__).exception("%s.end_program failed", type(backend).__name__)
