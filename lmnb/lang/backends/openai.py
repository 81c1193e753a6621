"""Runs programs on any OpenAI-compatible endpoint (OpenAI, vLLM, SGLang, the lmnb server).

    backend = lmnb.OpenAI("gpt-4o-mini")                              # OPENAI_API_KEY
    backend = lmnb.OpenAI("m", base_url="http://127.0.0.1:30000/v1")  # a local server
    state = program.run(backend=backend)
    backend.token_usage                                     # calls, prompt and completion tokens

Completion models get the program's text as the prompt; chat models get its role messages, so
text outside roles is an error there, and a gen must follow `assistant()` directly unless the
endpoint continues a final assistant message (`continue_final_message=True`, vLLM's extension) or
the program speculates (`@function(num_api_spec_tokens=N)`, `lmnb.lang.speculation`).
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmnb.lang.backends.base import (
    ChatPrompt,
    Generation,
    MediaInput,
    MediaUnsupported,
    ProgramAborted,
)
from lmnb.lang.chat_template import ChatTemplate
from lmnb.lang.ir import GenParams
from lmnb.params import default_sampling_params
from lmnb.runtime.output.stop import compile_stop_regex, first_stop_regex_match

if TYPE_CHECKING:  # the `openai` package is imported when a client is built, not with lmnb
    import openai
    from openai.types import CompletionChoice, CompletionUsage
    from openai.types.chat.chat_completion import Choice as ChatChoice
    from openai.types.chat.chat_completion_chunk import Choice as ChatChunkChoice

    # a choice of a completion (streamed or not), a chat completion, or a chat chunk
    AnyChoice = CompletionChoice | ChatChoice | ChatChunkChoice

# Known completion (non-chat) models of the OpenAI API; any other name is taken as a chat model.
COMPLETION_MODELS = ("gpt-3.5-turbo-instruct", "davinci-002", "babbage-002")
# OpenAI's own names for the parameters the standard API has.
_STANDARD = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
             "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
             "seed": "seed", "n": "n"}
# Extensions that SGLang- and vLLM-compatible servers accept in the body; sent only when a gen
# sets them away from the default, so that plain OpenAI endpoints never see them.
_EXTRA = {"top_k": "top_k", "min_p": "min_p", "min_new_tokens": "min_tokens",
          "ignore_eos": "ignore_eos", "stop_token_ids": "stop_token_ids", "regex": "regex",
          "ebnf": "ebnf"}
_DEFAULTS = default_sampling_params()
_FINISH = {"stop": "stop", "length": "length"}


class TokenUsage:
    """Calls and billed tokens of one backend, counted from the endpoint's `usage`; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def add(self, prompt_tokens: int, completion_tokens: int) -> None:
        with self._lock:
            self.calls += 1
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens

    def reset(self) -> None:
        with self._lock:
            self.calls = self.prompt_tokens = self.completion_tokens = 0

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {"calls": self.calls, "prompt_tokens": self.prompt_tokens,
                    "completion_tokens": self.completion_tokens}

    def __repr__(self) -> str:
        values = self.as_dict()
        return (f"TokenUsage(calls={values['calls']}, prompt_tokens={values['prompt_tokens']}, "
                f"completion_tokens={values['completion_tokens']})")


@dataclass
class _Reply:
    """One choice of a call, accumulated from a stream or read from a response."""

    text: str = ""
    finish_reason: str | None = None
    matched: str | int | None = None
    logprobs: list[tuple[float | None, None, str]] | None = None  # (logprob, id, token text)

    def add_logprobs(self, choice: AnyChoice) -> None:
        """Appends a choice's (or chunk's) output logprobs: chat `content` or completion
        `tokens`/`token_logprobs`."""
        from openai.types import CompletionChoice

        if choice.logprobs is None:
            return
        if isinstance(choice, CompletionChoice):
            pairs = list(zip(choice.logprobs.token_logprobs or [], choice.logprobs.tokens or [],
                             strict=False))
        else:
            pairs = [(item.logprob, item.token) for item in choice.logprobs.content or []]
        self.logprobs = (self.logprobs or []) + [(lp, None, token) for lp, token in pairs]


class OpenAI:
    """Backend (`lmnb.lang.backends.base.Backend`) over an OpenAI-compatible endpoint through the
    official `openai` client.

    `is_chat_model`: None guesses from the name (`COMPLETION_MODELS` are completion models).
    `client`: an `openai.OpenAI` to use as it is (tests give one over an in-process transport);
    otherwise one is built from `base_url`, `api_key` (default `$OPENAI_API_KEY`, else "EMPTY"
    for local servers) and `client_options`."""

    def __init__(self, model: str, base_url: str | None = None, api_key: str | None = None, *,
                 is_chat_model: bool | None = None, chat_template: ChatTemplate | None = None,
                 continue_final_message: bool = False, client: openai.OpenAI | None = None,
                 **client_options: Any) -> None:
        if client is None:
            import openai

            api_key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
            client = openai.OpenAI(base_url=base_url, api_key=api_key, **client_options)
        self.client = client
        self.model = model
        self.is_chat_model = (model not in COMPLETION_MODELS if is_chat_model is None
                              else is_chat_model)
        self.continue_final_message = continue_final_message
        # The remote model's template is unknown: roles render as plain `Role: ` text (shown in
        # the program's text; chat models are sent messages, not this text).
        self.chat_template = chat_template or ChatTemplate()
        self.token_usage = TokenUsage()

    # Output logprobs come with token texts (`meta_info["output_token_logprobs"]` entries are
    # `(logprob, None, text)`), which API speculation uses to size each served gen.
    reports_token_texts = True
    is_chat_model: bool

    def prepare_media(self, kind: str, source: Any, *,
                      num_frames: int | None = None) -> MediaInput:
        """`Backend.prepare_media`: this backend sends text (or text messages) only."""
        raise MediaUnsupported(f"lmnb.OpenAI sends text only: {self.model} gets no {kind}s "
                               "from a program")

    def __repr__(self) -> str:
        kind = "chat" if self.is_chat_model else "completion"
        return f"lmnb.OpenAI({self.model!r}, {kind} model, base_url={str(self.client.base_url)!r})"

    # ---- gen -------------------------------------------------------------------------------
    def generate(self, prompt: str, params: GenParams, *,
                 on_delta: Callable[[str], None] | None = None,
                 cancel: threading.Event | None = None,
                 chat: ChatPrompt | None = None) -> Generation:
        if cancel is not None and cancel.is_set():
            raise ProgramAborted("the program was interrupted")
        n = params.n or 1
        kwargs = self._request(params)
        if self.is_chat_model:
            kwargs["messages"] = self._messages(chat)
            create = self.client.chat.completions.create
            if params.json_schema is not None:
                kwargs["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": "output", "schema": json.loads(params.json_schema)}}
        else:
            kwargs["prompt"] = prompt
            create = self.client.completions.create
            if params.json_schema is not None:  # SGLang's completion field
                kwargs.setdefault("extra_body", {})["json_schema"] = params.json_schema
        stop_regex = compile_stop_regex(params.stop_regex)
        if n == 1:
            reply, usage = self._stream(create, kwargs, on_delta, cancel, stop_regex)
            replies = [reply]
        else:
            replies, usage = self._complete(create, kwargs, n, stop_regex)
        metas = [self._meta(reply, usage, n) for reply in replies]
        if n == 1:
            return Generation(replies[0].text, metas[0])
        return Generation([reply.text for reply in replies], metas)

    def _request(self, params: GenParams) -> dict[str, Any]:
        values = params.sampling_values()  # the merged gen's set sampling parameters
        kwargs: dict[str, Any] = {"model": self.model}
        for key, name in _STANDARD.items():
            if key in values and not (key == "n" and values[key] == 1):
                kwargs[name] = values[key]
        if params.stop:
            kwargs["stop"] = list(params.stop)
        if params.return_logprob:
            if self.is_chat_model:
                kwargs["logprobs"] = True
                if params.top_logprobs_num:
                    kwargs["top_logprobs"] = params.top_logprobs_num
            else:
                kwargs["logprobs"] = params.top_logprobs_num or 0
        extra = {name: values[key] for key, name in _EXTRA.items()
                 if key in values and values[key] != _DEFAULTS.get(key) and values[key] != []}
        if extra:
            kwargs["extra_body"] = extra
        return kwargs

    def _messages(self, chat: ChatPrompt | None) -> list[dict[str, str]]:
        if chat is None or chat.role is None:
            raise ValueError("a chat model generates inside assistant(): put the gen in an "
                             "assistant role")
        if chat.role != "assistant":
            raise ValueError(f"a chat model generates only in an assistant turn, not in "
                             f"{chat.role!r}")
        messages = [dict(m) for m in chat.messages]
        if chat.partial:
            if not self.continue_final_message:
                raise ValueError(
                    f"a chat model's reply starts at assistant(): this gen follows "
                    f"{chat.partial[-40:]!r} in the assistant turn. Use "
                    f"@function(num_api_spec_tokens=N) (API speculative execution), or "
                    f"lmnb.OpenAI(..., continue_final_message=True) for endpoints that continue "
                    f"a final assistant message (vLLM)")
            messages.append({"role": "assistant", "content": chat.partial})
        return messages

    def _chat_extra(self, kwargs: dict[str, Any]) -> None:
        messages = kwargs.get("messages")
        if messages and messages[-1]["role"] == "assistant":
            kwargs.setdefault("extra_body", {}).update(
                {"continue_final_message": True, "add_generation_prompt": False})

    def _stream(self, create: Callable[..., Any], kwargs: dict[str, Any],
                on_delta: Callable[[str], None] | None, cancel: threading.Event | None,
                stop_regex: list[re.Pattern]) -> tuple[_Reply, CompletionUsage | None]:
        self._chat_extra(kwargs)
        stream = create(stream=True, stream_options={"include_usage": True}, **kwargs)
        reply, usage, streamed = _Reply(), None, 0
        try:
            for chunk in stream:
                if cancel is not None and cancel.is_set():
                    raise ProgramAborted("the program was interrupted")
                usage = chunk.usage or usage
                for choice in chunk.choices or ():
                    reply.text += _choice_text(choice) or ""
                    reply.finish_reason = choice.finish_reason or reply.finish_reason
                    reply.matched = _matched_stop(choice) or reply.matched
                    reply.add_logprobs(choice)
                if _cut(reply, stop_regex):
                    break
                if on_delta is not None and len(reply.text) > streamed:
                    on_delta(reply.text[streamed:])
                    streamed = len(reply.text)
        finally:
            stream.close()
        if on_delta is not None and len(reply.text) > streamed:
            on_delta(reply.text[streamed:])
        self._count(usage)
        return reply, usage

    def _complete(self, create: Callable[..., Any], kwargs: dict[str, Any], n: int,
                  stop_regex: list[re.Pattern]) -> tuple[list[_Reply], CompletionUsage | None]:
        self._chat_extra(kwargs)
        response = create(**kwargs)
        replies = [_Reply() for _ in range(n)]
        for choice in response.choices:
            reply = replies[choice.index]
            reply.text = _choice_text(choice) or ""
            reply.finish_reason, reply.matched = choice.finish_reason, _matched_stop(choice)
            reply.add_logprobs(choice)
            _cut(reply, stop_regex)
        self._count(response.usage)
        return replies, response.usage

    def _count(self, usage: CompletionUsage | None) -> None:
        if usage is not None:  # servers may leave a count out (null)
            self.token_usage.add(usage.prompt_tokens or 0, usage.completion_tokens or 0)

    @staticmethod
    def _meta(reply: _Reply, usage: CompletionUsage | None, n: int) -> dict[str, Any]:
        reason: dict[str, Any] = {"type": _FINISH.get(reply.finish_reason or "",
                                                      reply.finish_reason)}
        if reply.matched is not None:
            reason["matched"] = reply.matched
        meta: dict[str, Any] = {"finish_reason": reason}
        if reply.logprobs is not None:
            meta["output_token_logprobs"] = reply.logprobs
        if usage is not None:
            meta["prompt_tokens"] = usage.prompt_tokens
            if n == 1:  # per choice only when there is one
                meta["completion_tokens"] = usage.completion_tokens
        return meta

    def cache_prefix(self, prompt: str) -> None:
        """Nothing to do: an API endpoint caches (or not) on its own."""

    # ---- select ----------------------------------------------------------------------------
    def select(self, prompt: str, choices: tuple[str, ...], method: str) -> tuple[str, dict]:
        """Scores every `prompt + choice` in one completions call with `echo=True` and
        `logprobs` (the choice's prompt-token logprobs); needs a completion endpoint that
        returns them. Methods: token_length_normalized, greedy_token_selection."""
        if method not in _SELECT_METHODS:
            raise ValueError(f"select(method={method!r}) is not available on an API model: it "
                             f"needs the model's unconditional logprobs; use one of "
                             f"{sorted(_SELECT_METHODS)}")
        if self.is_chat_model:
            raise ValueError(f"select(method={method!r}) scores choices by prompt logprobs "
                             f"(completions with echo=True and logprobs), which chat endpoints "
                             f"do not give; use a completion model (is_chat_model=False) or gen")
        if not choices:
            raise ValueError("select needs a non-empty list of choices")
        texts = [prompt + choice for choice in choices]
        import openai

        try:
            response = self.client.completions.create(
                model=self.model, prompt=texts, echo=True, logprobs=1, max_tokens=1,
                temperature=0)
        except openai.BadRequestError as error:
            raise ValueError(f"select(method={method!r}) needs prompt logprobs, and this endpoint "
                             f"refused completions with echo=True and logprobs=1: "
                             f"{error}") from error
        self._count(response.usage)
        scored: list[list[float]] = [[] for _ in choices]
        for choice in response.choices:
            scored[choice.index] = _choice_logprobs(choice, len(prompt), len(texts[choice.index]),
                                                    method)
        for text, values in zip(choices, scored, strict=True):
            if not values:
                raise ValueError(f"select: the endpoint gave no logprob for choice {text!r}")
        index = _SELECT_METHODS[method](scored)
        meta = {"method": method, "input_token_logprobs": scored,
                "normalized_prompt_logprobs": [sum(v) / len(v) for v in scored]}
        return choices[index], meta


def _token_length_normalized(scored: list[list[float]]) -> int:
    means = [sum(values) / len(values) for values in scored]
    return means.index(max(means))


def _greedy_token_selection(scored: list[list[float]]) -> int:
    """The choice that wins token by token: the best first token, ties broken by the next."""
    width = max(len(values) for values in scored)
    rows = [values + [-math.inf] * (width - len(values)) for values in scored]
    remaining = list(range(len(rows)))
    for j in range(width):
        best = max(rows[i][j] for i in remaining)
        remaining = [i for i in remaining if rows[i][j] == best]
        if len(remaining) == 1:
            break
    return remaining[0]


_SELECT_METHODS: dict[str, Callable[[list[list[float]]], int]] = {
    "token_length_normalized": _token_length_normalized,
    "greedy_token_selection": _greedy_token_selection,
}


def _choice_logprobs(choice: CompletionChoice, start: int, end: int,
                     method: str) -> list[float]:
    """Logprobs of the echoed tokens that overlap characters [start, end) of the prompt."""
    logprobs = choice.logprobs
    if (logprobs is None or not logprobs.tokens or logprobs.token_logprobs is None
            or logprobs.text_offset is None):
        raise ValueError(f"select(method={method!r}) needs prompt logprobs, and this endpoint "
                         f"returned none for completions with echo=True and logprobs=1")
    picked = []
    for token, value, offset in zip(logprobs.tokens, logprobs.token_logprobs,
                                    logprobs.text_offset, strict=False):
        if offset < end and offset + len(token) > start and value is not None:
            picked.append(float(value))
    return picked


def _choice_text(choice: AnyChoice) -> str | None:
    """A choice's text: a completion's (or its streamed chunk's) `text`, a chat chunk's `delta`,
    a chat reply's `message`."""
    from openai.types import CompletionChoice
    from openai.types.chat.chat_completion_chunk import Choice as ChatChunkChoice

    if isinstance(choice, CompletionChoice):
        return choice.text
    if isinstance(choice, ChatChunkChoice):
        return choice.delta.content
    return choice.message.content


def _matched_stop(choice: AnyChoice) -> str | int | None:
    """The stop that ended a choice, where the server says (SGLang: matched_stop, vLLM:
    stop_reason)."""
    extra = choice.model_extra or {}
    return extra.get("matched_stop", extra.get("stop_reason"))


def _cut(reply: _Reply, stop_regex: Sequence[re.Pattern]) -> bool:
    """Ends `reply` at the first `stop_regex` match (client-side); True if it did."""
    match = first_stop_regex_match(stop_regex, reply.text)
    if match is None:
        return False
    reply.text, reply.finish_reason, reply.matched = reply.text[:match.start()], "stop", \
        match.group()
    return True
