"""OpenAI's API over the runtime: `/v1/models`, `/v1/completions`, `/v1/chat/completions`
(streaming as server-sent events ending with `data: [DONE]`); `/v1/embeddings` and
`/v1/responses` are refused in words. A request's omitted temperature, top_p, top_k, min_p and
repetition_penalty are the model's generation_config.json values, as SGLang's chat and vLLM's
chat and completions take them, unless the runtime's `sampling_defaults` is 'openai'. The module
is not named `openai` so that it never shadows the `openai` package."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from lmnb.runtime.output import OutputStream
from lmnb.server.errors import APIError
from lmnb.server.media import chat_media
from lmnb.server.messages import openai_messages
from lmnb.server.open_requests import OpenRequests, caller_ids
from lmnb.server.stream_logprobs import (
    StreamedLogprobs,
    TokenPieces,
    chat_logprobs,
    new_chat_logprobs,
)
from lmnb.server.streams import (
    Chunk,
    EventStream,
    ServedRuntime,
    chunk_index,
    chunks,
    closed_on_disconnect,
    collect,
    finish_type,
    matched_stop,
    open_stream,
    sse,
    sse_error,
)
from lmnb.server.tool_run import ChoiceResult, ToolRun
from lmnb.server.tools import (
    ArgumentsDelta,
    CallStream,
    openai_tool_choice,
    openai_tools,
    tool_plan,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# A JSON object of any shape (`response_format: json_object`).
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}
# The most alternatives per token: OpenAI's chat `top_logprobs` bound, and vLLM's
# `max_logprobs` default, which it applies to completions' `logprobs` too (OpenAI's: 5).
MAX_LOGPROBS = 20


class StreamOptions(BaseModel):
    """`include_usage`: a last chunk with the whole usage; `continuous_usage_stats` (SGLang's
    and vLLM's): every chunk with its choice's usage so far. Unknown keys are kept only so that
    `empty` tells `{}` from any other object."""

    model_config = ConfigDict(extra="allow")
    include_usage: bool = False
    continuous_usage_stats: bool = False

    def chunk(self, head: dict[str, Any], choice: dict[str, Any], meta: dict[str, Any]) -> str:
        """The event of one choice's chunk; `meta` is its request's meta_info so far."""
        body = {**head, "choices": [choice]}
        if self.continuous_usage_stats:
            prompt, completion = meta.get("prompt_tokens", 0), meta.get("completion_tokens", 0)
            body["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion}
        return sse(body)

    @property
    def empty(self) -> bool:
        """Sent as `{}` (or built with nothing set)."""
        return not self.model_fields_set


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class _Sampling(BaseModel):
    """Fields shared by both endpoints (OpenAI's, then SGLang's extras)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    # SGLang's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    regex: str | None = None
    json_schema: dict[str, Any] | str | None = None
    ebnf: str | None = None
    # SGLang's: the requests' ids for `/abort_request` (a string, or one per prompt)
    rid: str | list[str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data: Any) -> Any:
        """A null field is one not given (OpenAI's fields are nullable): its default."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    @property
    def streamed(self) -> StreamOptions:
        return self.stream_options or StreamOptions()

    def check_stream_options(self) -> None:
        """`stream_options` without `stream` is a 400, as OpenAI's API and vLLM refuse it;
        an empty object passes, as in vLLM (SGLang passes any)."""
        if self.stream_options is not None and not self.stream_options.empty and not self.stream:
            raise APIError("Stream options can only be defined when `stream=True`.",
                           param="stream_options")

    def caller_ids(self, response_id: str, prompts: int, samples: int) -> list[str]:
        """The ids `/abort_request` finds the results of `prompts` prompts of `samples` each
        by, named as SGLang names them (`caller_ids`): from `rid`, else from the response's
        id."""
        if isinstance(self.rid, list) and len(self.rid) != prompts:
            raise APIError(f"rid has {len(self.rid)} ids for {prompts} prompts", param="rid")
        return caller_ids(response_id if self.rid is None else self.rid, [samples] * prompts)

    def sampling_params(self, max_new_tokens: int | None,
                        defaults: Mapping[str, Any]) -> dict[str, Any]:
        """`generate`'s parameters: the request's, else `defaults` (the model's), else lmnb's."""
        params: dict[str, Any] = {**defaults, "max_new_tokens": max_new_tokens, "n": self.n}
        for ours, value in (("temperature", self.temperature), ("top_p", self.top_p),
                            ("stop", self.stop), ("frequency_penalty", self.frequency_penalty),
                            ("presence_penalty", self.presence_penalty), ("seed", self.seed),
                            ("top_k", self.top_k), ("min_p", self.min_p),
                            ("repetition_penalty", self.repetition_penalty),
                            ("min_new_tokens", self.min_tokens), ("ignore_eos", self.ignore_eos),
                            ("stop_token_ids", self.stop_token_ids),
                            ("skip_special_tokens", self.skip_special_tokens),
                            ("regex", self.regex), ("json_schema", self.json_schema),
                            ("ebnf", self.ebnf), ("logit_bias", self.logit_bias)):
            if value is not None:
                params[ours] = value
        return params


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    def candidates(self) -> int:
        """Completions generated per prompt: `best_of` (at least `n`; not streamed unless it is
        `n`), else `n`."""
        if self.best_of is None or self.best_of == self.n:
            return self.n
        if self.best_of < self.n:
            raise APIError(f"best_of ({self.best_of}) must be at least n ({self.n})",
                           param="best_of")
        if self.stream:
            raise APIError("best_of greater than n cannot be streamed", param="best_of")
        return self.best_of


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's and SGLang's extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def prompt(self, runtime: ServedRuntime, messages: list[dict[str, Any]],
               tools: list[dict[str, Any]] | None) -> str:
        """The prompt text of `messages` (`chat_template_kwargs`: more variables of the
        template): with `continue_final_message`, the reply continues the last (assistant)
        message; without `add_generation_prompt`, no assistant opening follows the messages."""
        variables = self.chat_template_kwargs
        if not self.continue_final_message:
            return runtime.apply_chat_template(messages, self.add_generation_prompt,
                                               tools=tools, template_kwargs=variables)
        if self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
            raise APIError("continue_final_message and add_generation_prompt cannot both be "
                           "true", param="continue_final_message")
        last = messages[-1]
        if (last.get("role") != "assistant" or last.get("tool_calls")
                or not isinstance(last.get("content"), str)):
            raise APIError("continue_final_message needs a last assistant message of text",
                           param="messages")
        return runtime.apply_chat_template(messages[:-1], tools=tools,
                                           template_kwargs=variables) + last["content"]

    def logprob_kwargs(self) -> dict[str, Any]:
        """`generate`'s logprob arguments; `top_logprobs` asks for nothing without `logprobs`
        (refused, as vLLM does)."""
        if self.top_logprobs and not self.logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        return {"return_logprob": self.logprobs, "top_logprobs_num": self.top_logprobs or 0}


def _response_format_schema(fmt: ResponseFormat | None) -> dict[str, Any] | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return JSON_OBJECT_SCHEMA
    spec = fmt.json_schema or {}
    schema = spec.get("schema", spec.get("schema_"))
    if not isinstance(schema, dict):
        raise APIError("response_format.json_schema.schema must be a JSON schema object",
                       param="response_format")
    return schema


def _usage(results: list[Chunk], n: int) -> dict[str, Any]:
    """OpenAI's usage: each prompt counted once however many choices (`n`, consecutive in
    `results`) it has; its cached tokens are those found cached before this request, the
    fewest any of its choices found (the later ones reuse the first's prefill): never more
    than `prompt_tokens`."""
    metas = [r["meta_info"] for r in results]
    groups = [metas[i:i + n] for i in range(0, len(metas), n)]
    prompt = sum(group[0].get("prompt_tokens", 0) for group in groups)
    completion = sum(m.get("completion_tokens", 0) for m in metas)
    cached = sum(min(m.get("cached_tokens", 0) for m in group) for group in groups)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _per_token_logprob(result: Chunk) -> float:
    logprobs = [lp for lp, _ in result["meta_info"].get("output_token_logprobs") or ()
                if lp is not None]
    return sum(logprobs) / len(logprobs) if logprobs else 0.0


def _best(results: list[Chunk], candidates: int, n: int) -> list[Chunk]:
    """Of each prompt's `candidates` results (consecutive), the `n` with the highest log
    probability per token, likeliest first (OpenAI's `best_of`)."""
    if candidates == n:
        return results
    groups = [results[i:i + candidates] for i in range(0, len(results), candidates)]
    return [r for group in groups
            for r in sorted(group, key=_per_token_logprob, reverse=True)[:n]]


def _completion_logprobs(meta: dict[str, Any], tokens: TokenPieces, echo: bool = False,
                         offset: int = 0) -> dict[str, Any]:
    """OpenAI's legacy logprobs of the output tokens, the first at text `offset`; with `echo`,
    the prompt's tokens first (the first of them has no logprob: null, as in vLLM)."""
    texts: list[str] = []
    logprobs: list[float | None] = []
    offsets: list[int] = []
    top: list[dict[str, float] | None] = []

    def add(pairs: list[Any], tops: list[Any], prompt: bool) -> None:
        nonlocal offset
        for i, (logprob, token_id) in enumerate(pairs):
            text = tokens.text(token_id)
            texts.append(text)
            first = prompt and logprob is None
            logprobs.append(None if first else 0.0 if logprob is None else logprob)
            offsets.append(offset)
            offset += len(text)
            row = tops[i] if i < len(tops) else None
            top.append(None if first else {tokens.text(tid): lp for lp, tid in row or []})

    if echo:
        add(meta.get("input_token_logprobs") or [], meta.get("input_top_logprobs") or [], True)
    add(meta.get("output_token_logprobs") or [], meta.get("output_top_logprobs") or [], False)
    return {"tokens": texts, "token_logprobs": logprobs, "top_logprobs": top,
            "text_offset": offsets}


def make_router(runtime: ServedRuntime, model_name: str,
                open_requests: OpenRequests) -> APIRouter:
    """The OpenAI routes; a request's `rid` finds its requests in `open_requests` while they
    run (`/abort_request`)."""
    router = APIRouter()
    tokens = TokenPieces(runtime.tokenizer)
    # generation_config.json's sampling parameters, for the fields a request leaves out
    defaults = (runtime.model_config.generation_defaults
                if runtime.engine_config.sampling_defaults == "model" else {})

    # OpenAI's model fields, then Anthropic's (its SDK's models.list reads the same route)
    card = {"id": model_name, "object": "model", "created": 0, "owned_by": "lmnb",
            "root": model_name, "max_model_len": runtime.context_len,
            "type": "model", "display_name": model_name, "created_at": "1970-01-01T00:00:00Z",
            "max_input_tokens": runtime.context_len}

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card],
                "has_more": False, "first_id": model_name, "last_id": model_name}

    @router.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        if model != model_name:
            raise APIError(f"the model {model!r} does not exist; this server serves "
                           f"{model_name!r}", status=404, param="model",
                           code="model_not_found")
        return card

    @router.post("/v1/embeddings")
    async def embeddings() -> None:
        raise APIError(f"{model_name!r} is a generative model: lmnb serves no embeddings "
                       "(/v1/embeddings)", code="unsupported_endpoint")

    @router.post("/v1/responses")
    async def responses() -> None:
        raise APIError("lmnb does not serve OpenAI's Responses API (/v1/responses); use Chat "
                       "Completions (/v1/chat/completions)", status=404,
                       code="unsupported_endpoint")

    @router.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        body.check_stream_options()
        if body.suffix:
            raise APIError("suffix is not supported", param="suffix")
        prompt, input_ids = _completion_prompt(body.prompt)
        top = body.logprobs or 0
        with_logprobs = body.logprobs is not None
        candidates = body.candidates()  # ranked by their logprobs when more than n
        params = body.sampling_params(16 if body.max_tokens is None else body.max_tokens,
                                      defaults)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": model_name}
        ids = body.caller_ids(rid, _prompt_count(prompt, input_ids), candidates)
        stream = await open_stream(
            runtime, prompt, {**params, "n": candidates}, input_ids=input_ids,
            return_logprob=with_logprobs or candidates > body.n, top_logprobs_num=top,
            logprob_start_len=0 if body.echo and with_logprobs else None)
        echoed = _echoed(prompt, input_ids, runtime.tokenizer) if body.echo else None
        if body.stream:
            return _sse_response(open_requests.tracked_events(ids, stream, _completion_events(
                stream, head, body.n, body.streamed, with_logprobs, tokens, echoed)))
        with open_requests.tracked(ids, stream):
            results = await collect(request, stream)
        usage = _usage(results, candidates)
        results = _best(results, candidates, body.n)
        choices = [{"index": i,
                    "text": (echoed[i // body.n] if echoed else "") + r["text"],
                    "logprobs": (_completion_logprobs(r["meta_info"], tokens, body.echo)
                                 if with_logprobs else None),
                    **_finish(r["meta_info"])}
                   for i, r in enumerate(results)]
        return {**head, "choices": choices, "usage": usage}

    @router.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatRequest, request: Request) -> Any:
        body.check_stream_options()
        messages, images = chat_media(
            openai_messages(body.messages),
            takes_images=runtime.model_config.image_token_id is not None)
        tools = openai_tools(body.tools)
        tool_choice = openai_tool_choice(body.tool_choice, body.parallel_tool_calls, tools)
        plan = tool_plan(tools, tool_choice, runtime.tokenizer)
        prompt = body.prompt(runtime, messages, plan.prompt_tools() if plan else None)
        # neither: up to the context length (None), as SGLang's and vLLM's
        limit = body.max_tokens if body.max_completion_tokens is None else (
            body.max_completion_tokens)
        params = body.sampling_params(limit, defaults)
        schema = _response_format_schema(body.response_format)
        if schema is not None:
            if body.regex is not None or body.json_schema is not None or body.ebnf is not None:
                raise APIError("give either response_format or regex / json_schema / ebnf",
                               param="response_format")
            params["json_schema"] = schema
        generate_kwargs = body.logprob_kwargs()
        if images:
            generate_kwargs["image_data"] = images
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "created": created, "model": model_name}
        if plan is not None:
            if body.rid is not None:
                raise APIError("rid cannot be combined with tools unless tool_choice is 'none'",
                               param="rid")
            if any(key in params for key in ("regex", "json_schema", "ebnf")):
                raise APIError("response_format, regex, json_schema and ebnf cannot be combined "
                               "with tools unless tool_choice is 'none'", param="tool_choice")
            run = ToolRun(runtime, plan, prompt, params, **generate_kwargs)
            if body.stream:
                await run.start()  # a refused request is a 400 before the stream starts
                return _sse_response(_tool_chat_events(run, head, body.n, body.streamed,
                                                       body.logprobs, tokens))
            async with closed_on_disconnect(request, run):
                tool_results = await run.results()
            choices = [_tool_choice_body(i, r, body.logprobs, tokens)
                       for i, r in enumerate(tool_results)]
            return {**head, "object": "chat.completion", "choices": choices,
                    "usage": _usage([{"meta_info": r.meta} for r in tool_results], body.n)}
        ids = body.caller_ids(rid, 1, body.n)
        stream = await open_stream(runtime, prompt, params, **generate_kwargs)
        if body.stream:
            return _sse_response(open_requests.tracked_events(ids, stream, _chat_events(
                stream, head, body.n, body.streamed, body.logprobs, tokens)))
        with open_requests.tracked(ids, stream):
            results = await collect(request, stream)
        choices = [{"index": i, "message": {"role": "assistant", "content": r["text"]},
                    "logprobs": (chat_logprobs(r["meta_info"], tokens)
                                 if body.logprobs else None),
                    **_finish(r["meta_info"])}
                   for i, r in enumerate(results)]
        return {**head, "object": "chat.completion", "choices": choices,
                "usage": _usage(results, body.n)}

    return router


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _finish(meta: dict[str, Any], calls: int = 0) -> dict[str, Any]:
    """A finished choice's `finish_reason` (`tool_calls` when it made calls and stopped of
    itself, as SGLang's: a call cut by max_tokens is `length`, an aborted one `abort`) and
    SGLang's `matched_stop`."""
    finish = finish_type(meta)
    return {"finish_reason": "tool_calls" if calls and finish == "stop" else finish,
            "matched_stop": matched_stop(meta)}


def _tool_choice_body(index: int, result: ChoiceResult, logprobs: bool,
                      tokens: TokenPieces) -> dict[str, Any]:
    calls = [{"id": _call_id(), "type": "function",
              "function": {"name": c.name, "arguments": c.arguments}} for c in result.calls]
    message: dict[str, Any] = {"role": "assistant",
                               "content": result.text if result.text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return {"index": index, "message": message,
            "logprobs": chat_logprobs(result.meta, tokens) if logprobs else None,
            **_finish(result.meta, len(calls))}


def _completion_prompt(prompt: Any) -> tuple[Any, Any]:
    """(prompt text or texts, input ids or lists of ids): one of them is None."""
    if isinstance(prompt, str):
        return prompt, None
    if prompt and all(isinstance(p, str) for p in prompt):
        return prompt, None
    if prompt and all(isinstance(p, int) for p in prompt):
        return None, prompt
    if prompt and all(isinstance(p, list) for p in prompt):
        return None, prompt
    raise APIError("prompt must be a string, a list of strings, a list of token ids or a list "
                   "of lists of token ids", param="prompt")


def _prompt_count(prompt: Any, input_ids: Any) -> int:
    """How many prompts `_completion_prompt`'s text or ids are."""
    if isinstance(prompt, str) or (input_ids is not None and isinstance(input_ids[0], int)):
        return 1
    return len(prompt if prompt is not None else input_ids)


def _echoed(prompt: Any, input_ids: Any, tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """Each prompt's text as `echo` repeats it (prompts of ids decoded, as vLLM does)."""
    if prompt is not None:
        return [prompt] if isinstance(prompt, str) else list(prompt)
    lists = input_ids if isinstance(input_ids[0], list) else [input_ids]
    return [tokenizer.decode(ids) for ids in lists]


def _sse_response(events: AsyncIterator[str]) -> EventStream:
    return EventStream(events, sse_error, media_type="text/event-stream",
                       headers={"Cache-Control": "no-cache"})


async def _completion_events(stream: OutputStream, head: dict[str, Any], n: int,
                             options: StreamOptions, logprobs: bool, tokens: TokenPieces,
                             echoed: list[str] | None) -> AsyncGenerator[str, None]:
    """A chunk per text delta of each choice (with `echo`, its prompt first) with the logprobs
    of its tokens (with `echo`, all in the last), the finish reason in its last."""
    finals: dict[int, Chunk] = {}
    started: set[int] = set()
    streamed = StreamedLogprobs()
    offsets: dict[int, int] = {}  # per choice, the text offset of its next logprob token
    async for chunk in chunks(stream):
        meta = chunk["meta_info"]
        done = meta.get("finish_reason") is not None
        index = chunk_index(chunk)
        streamed.add(index, meta)
        if done:
            finals[index] = chunk
        text = chunk["text"]
        if echoed and index not in started:
            text = echoed[index // n] + text
        if not text and not done:
            continue
        started.add(index)
        new = streamed.take(index) if logprobs and (done or not echoed) else None
        entries = None
        if new is not None:  # with `echo`, the prompt's (in `meta`) first
            entries = _completion_logprobs({**meta, **new}, tokens, echoed is not None,
                                           offset=offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + sum(map(len, entries["tokens"]))
        choice = {"index": index, "text": text, "logprobs": entries,
                  **(_finish(meta) if done else {"finish_reason": None})}
        yield options.chunk(head, choice, meta)
    if options.include_usage:
        results = [finals[i] for i in sorted(finals)]
        yield sse({**head, "choices": [], "usage": _usage(results, n)})
    yield sse("[DONE]")


async def _chat_events(stream: OutputStream, head: dict[str, Any], n: int,
                       options: StreamOptions, logprobs: bool,
                       tokens: TokenPieces) -> AsyncGenerator[str, None]:
    """Per choice: a first delta with the role, content deltas with their tokens' logprobs,
    and a last chunk with the finish reason."""
    head = {**head, "object": "chat.completion.chunk"}
    started: set[int] = set()
    finals: dict[int, Chunk] = {}
    streamed = StreamedLogprobs() if logprobs else None
    async for chunk in chunks(stream):
        meta = chunk["meta_info"]
        index = chunk_index(chunk)
        done = meta.get("finish_reason") is not None
        if streamed is not None:
            streamed.add(index, meta)
        if index not in started:
            started.add(index)
            yield options.chunk(head, {"index": index, "delta": {"role": "assistant",
                                                                 "content": ""},
                                       "logprobs": None, "finish_reason": None}, meta)
        if chunk["text"]:
            yield options.chunk(head, {
                "index": index, "delta": {"content": chunk["text"]},
                "logprobs": new_chat_logprobs(streamed, index, tokens),
                "finish_reason": None}, meta)
        if done:
            finals[index] = chunk
            yield options.chunk(head, {
                "index": index, "delta": {},
                "logprobs": new_chat_logprobs(streamed, index, tokens),
                **_finish(meta)}, meta)
    if options.include_usage:
        results = [finals[i] for i in sorted(finals)]
        yield sse({**head, "choices": [], "usage": _usage(results, n)})
    yield sse("[DONE]")


async def _tool_chat_events(run: ToolRun, head: dict[str, Any], n: int, options: StreamOptions,
                            logprobs: bool, tokens: TokenPieces) -> AsyncIterator[str]:
    """`_chat_events` with calls: a call's first delta has its index, id, type and name (empty
    arguments), the next ones argument fragments."""
    head = {**head, "object": "chat.completion.chunk"}
    calls: dict[int, CallStream] = {}
    finals: dict[int, Chunk] = {}
    streamed = StreamedLogprobs() if logprobs else None

    def delta(index: int, body: dict[str, Any], meta: dict[str, Any],
              finish: dict[str, Any] | None = None) -> str:
        new = None if "role" in body else new_chat_logprobs(streamed, index, tokens)
        return options.chunk(head, {"index": index, "delta": body, "logprobs": new,
                                    **(finish or {"finish_reason": None})}, meta)

    async with aclosing(run.pieces()) as pieces:
        async for piece in pieces:
            index = piece.index
            if streamed is not None:
                streamed.add(index, piece.meta)
            if index not in calls:
                calls[index] = CallStream(run.plan.format)
                yield delta(index, {"role": "assistant", "content": ""}, piece.meta)
            if piece.text:
                yield delta(index, {"content": piece.text}, piece.meta)
            for event in calls[index].feed(piece.calls):
                if isinstance(event, ArgumentsDelta):
                    call = {"index": event.index, "function": {"arguments": event.text}}
                else:
                    call = {"index": event.index, "id": _call_id(), "type": "function",
                            "function": {"name": event.name, "arguments": ""}}
                yield delta(index, {"tool_calls": [call]}, piece.meta)
            if piece.done:
                finals[index] = {"meta_info": piece.meta}
                yield delta(index, {}, piece.meta, _finish(piece.meta, len(calls[index].calls)))
    if options.include_usage:
        results = [finals[i] for i in sorted(finals)]
        yield sse({**head, "choices": [], "usage": _usage(results, n)})
    yield sse("[DONE]")
