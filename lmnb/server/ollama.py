"""Ollama's API over the runtime: `/api/generate`, `/api/chat` (streamed as NDJSON by
default, as Ollama does), `/api/tags`, `/api/show` (the model's details and GGUF-style
`model_info`), `/api/ps` (the loaded model and its memory), `/api/version`, `/api/pull` of the
served model (here already); what one model loaded from its files cannot do (pull another,
push, create, copy, delete, embeddings) is a 501 saying so."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import re
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt

from lmnb.runtime.chat import adds_bos, strip_added_bos
from lmnb.runtime.config import ModelConfig
from lmnb.server.errors import APIError
from lmnb.server.messages import chat_messages
from lmnb.server.ollama_window import Window
from lmnb.server.stream_logprobs import (
    StreamedLogprobs,
    TokenPieces,
    new_chat_logprobs,
)
from lmnb.server.streams import (
    EventStream,
    ServedRuntime,
    chunks,
    closed_on_disconnect,
    finish_type,
    open_stream,
)
from lmnb.server.tool_run import ToolRun
from lmnb.server.tools import CallStream, ParsedCall, ToolChoice, ToolPlan, openai_tools, tool_plan

# Ollama's `options` -> SGLang's sampling parameter names.
_OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
            "num_predict": "max_new_tokens", "stop": "stop", "seed": "seed",
            "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
            "frequency_penalty": "frequency_penalty"}


class Options(BaseModel):
    """The `options` lmnb uses (others, e.g. `num_gpu`, are ignored), typed as Ollama's are:
    a value of the wrong type is a 400. `num_ctx` and `num_keep` shape the request's window
    (`lmnb.server.ollama_window`)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    num_predict: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    num_ctx: int | None = None
    num_keep: int | None = None


class _OllamaRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    stream: bool = True
    options: Options | None = None
    format: str | dict[str, Any] | None = None
    keep_alive: float | str | None = None  # seconds, or a Go duration ("5m"); < 0: forever
    think: bool | Literal["high", "medium", "low", "max"] | None = None
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=20)
    truncate: bool = True  # false: a prompt longer than the window is a 400, not cut

    def window(self, context_len: int) -> Window:
        options = self.options or Options()
        return Window.of(options.num_ctx, options.num_keep, self.truncate, context_len)


_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"
_GO_DURATION = re.compile(rf"[-+]?(?:{_NUMBER}(?:ns|us|µs|μs|ms|s|m|h))+")


def _unloads(keep_alive: float | str | None) -> bool:
    """Whether Ollama's `keep_alive` is zero (unload the model now). A string that is no Go
    duration is a 400, in Go's words as Ollama's."""
    if isinstance(keep_alive, str):
        if keep_alive.lstrip("+-") == "0":
            return True
        if not _GO_DURATION.fullmatch(keep_alive):
            raise APIError(f'time: invalid duration "{keep_alive}"', param="keep_alive")
        return not any(float(number) for number in re.findall(_NUMBER, keep_alive))
    return keep_alive is not None and 0 <= keep_alive < 1e-9  # under a nanosecond: 0


class GenerateRequest(_OllamaRequest):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    images: list[str] | None = None
    context: list[NonNegativeInt] | None = None  # a previous response's: before the prompt
    template: str | None = None  # a Go template: refused (lmnb cannot run them)
    suffix: str | None = None  # fill-in-the-middle: the text after the response


class ChatRequest(_OllamaRequest):
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None  # OpenAI's shape; the model chooses (auto)


class PullRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    name: str | None = None  # the field's name before Ollama 0.4
    stream: bool = True


class ShowRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    name: str | None = None  # the field's name before Ollama 0.4
    verbose: bool = False


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """What the model's safetensors headers say: parameters, the dtype most of them have (as
    Ollama's `quantization_level`: F32, BF16, F16, ...), bytes on disk, last modified, and a
    `digest` (64 hex digits, as Ollama's) of the files' names, sizes, modification times and
    headers: it changes when they do (hashing the weights would take minutes for a 7B)."""

    parameters: int
    dtype: str
    file_bytes: int
    modified_at: str
    digest: str

    @classmethod
    def read(cls, model_dir: Path | None) -> Checkpoint | None:
        files = sorted(Path(model_dir).glob("*.safetensors")) if model_dir else []
        if not files:
            return None
        by_dtype: dict[str, int] = {}
        digest = hashlib.sha256()
        stats = [file.stat() for file in files]
        for file, stat in zip(files, stats, strict=True):
            with file.open("rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = f.read(length)
            digest.update(f"{file.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode() + header)
            for name, entry in json.loads(header).items():
                if name != "__metadata__":
                    dtype = entry["dtype"]
                    by_dtype[dtype] = by_dtype.get(dtype, 0) + math.prod(entry["shape"])
        modified = max(stat.st_mtime for stat in stats)
        return cls(parameters=sum(by_dtype.values()), dtype=max(by_dtype, key=by_dtype.get),
                   file_bytes=sum(stat.st_size for stat in stats),
                   modified_at=_timestamp(datetime.fromtimestamp(modified, timezone.utc)),
                   digest=digest.hexdigest())


def parameter_size(count: int) -> str:
    """Ollama's short form: 8.0B, 134.52M, 900K."""
    if count >= 10**9:
        return f"{count / 1e9:.1f}B"
    if count >= 10**6:
        return f"{count / 1e6:.2f}M"
    return f"{count / 1e3:.0f}K" if count >= 10**3 else str(count)


def _params(body: _OllamaRequest) -> dict[str, Any]:
    params: dict[str, Any] = {}
    options = body.options.model_dump(exclude_none=True) if body.options else {}
    for key, value in options.items():
        if key not in _OPTIONS:  # the window's
            continue
        name = _OPTIONS[key]
        # a negative num_predict (Ollama's -1: no limit): up to the context length
        params[name] = value if name != "max_new_tokens" or value >= 0 else None
    if body.format == "json":
        params["json_schema"] = {"type": "object"}
    elif isinstance(body.format, dict):
        params["json_schema"] = body.format
    elif body.format not in (None, ""):
        raise APIError("format must be 'json' or a JSON schema", param="format")
    return params


def _no_thinking(body: _OllamaRequest, name: str) -> None:
    """`think` asks for the reasoning apart from the answer, which lmnb does not separate (its
    /api/show lists no `thinking` capability): Ollama's 400 for such a model."""
    if body.think not in (None, False):
        raise APIError(f'"{name}" does not support thinking', param="think")


def _timestamp(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


def _now() -> str:
    return _timestamp(datetime.now(timezone.utc))


def _no_images(runtime: ServedRuntime, where: str) -> APIError:
    kind = ("this model takes no images (it is a text-only model)"
            if runtime.model_config.image_token_id is None
            else "lmnb's Ollama API takes no images; send them as image_url parts to "
                 "/v1/chat/completions")
    return APIError(f"{where}: {kind}", param=where, code="images_not_supported")


@dataclass(slots=True)
class _Clock:
    """Ollama's durations (ns) of one request: the prompt's until its first output arrived,
    the output's from then on; no load time (the model is loaded while the server runs)."""

    started: float = field(default_factory=time.perf_counter)
    first: float | None = None

    def output(self) -> None:
        if self.first is None:
            self.first = time.perf_counter()

    def final(self, meta: dict[str, Any]) -> dict[str, Any]:
        """The last object's fields: the end, the reason, the counts and the durations."""
        end = time.perf_counter()
        first = end if self.first is None else self.first
        prompt, output = int((first - self.started) * 1e9), int((end - first) * 1e9)
        return {"done": True, "done_reason": finish_type(meta) or "stop",
                "total_duration": prompt + output, "load_duration": 0,
                "prompt_eval_count": meta.get("prompt_tokens", 0),
                "prompt_eval_duration": prompt,
                "eval_count": meta.get("completion_tokens", 0), "eval_duration": output}


class _Logprobs:
    """Ollama's `logprobs` of one reply, an object at a time: each object carries those of its
    tokens not given out yet (OpenAI's chat entries); nothing when none were asked for."""

    def __init__(self, body: _OllamaRequest, tokens: TokenPieces) -> None:
        self.streamed = StreamedLogprobs() if body.logprobs else None
        self.tokens = tokens

    @staticmethod
    def kwargs(body: _OllamaRequest) -> dict[str, Any]:
        """`generate`'s logprob arguments (a stream's running chunks carry their tokens')."""
        if not body.logprobs:
            return {}
        return {"return_logprob": True, "top_logprobs_num": body.top_logprobs}

    def add(self, meta: dict[str, Any]) -> None:
        """Reads a chunk's meta_info (every one, in order)."""
        if self.streamed is not None:
            self.streamed.add(0, meta)

    def new(self) -> dict[str, Any]:
        """`{"logprobs": [...]}` of the tokens read that were not given out yet."""
        if self.streamed is None:
            return {}
        entries = new_chat_logprobs(self.streamed, 0, self.tokens)
        return {} if entries is None else {"logprobs": entries["content"]}


def make_router(runtime: ServedRuntime, model_name: str) -> APIRouter:
    router = APIRouter()

    names = (model_name, f"{model_name}:latest")  # Ollama's tag defaults to latest
    tokens = TokenPieces(runtime.tokenizer)
    bos = adds_bos(runtime.tokenizer)

    def served(name: str | None, unnamed: APIError | None = None) -> str:
        """The model a request names; any other is a 404, as Ollama answers a model it does
        not have. A request that names none is `unnamed` (Ollama's answer differs by route),
        by default /api/chat's and /api/show's 400 `model is required`."""
        if name is None or not name.strip():
            raise unnamed or APIError("model is required", param="model")
        if name not in names:
            raise APIError(f"model '{name}' not found", status=404, type="not_found_error")
        return name

    async def run(request: Request, body: _OllamaRequest, prompt: str, ids: list[int],
                  chat: bool, context: bool = False) -> EventStream | dict[str, Any]:
        """Generates for `ids` (`prompt`'s, as the window holds them); with `context`, the last
        object carries the tokens of the prompt and the response (Ollama's `context`,
        tokenized as Ollama does: the texts)."""
        clock = _Clock()
        params = _params(body)
        params["max_new_tokens"] = body.window(runtime.context_len).max_new_tokens(
            params.get("max_new_tokens"), len(ids))
        stream = await open_stream(runtime, None, params, input_ids=ids,
                                   **_Logprobs.kwargs(body))
        logprobs = _Logprobs(body, tokens)
        model = body.model or model_name

        def piece(text: str) -> dict[str, Any]:
            if chat:
                return {"message": {"role": "assistant", "content": text}}
            return {"response": text}

        async def ending(text: str) -> dict[str, Any]:
            if not context:
                return {}
            return {"context": await asyncio.to_thread(runtime.encode, prompt + text)}

        async def lines() -> AsyncIterator[str]:
            texts: list[str] = []
            async for chunk in chunks(stream):
                clock.output()
                meta = chunk["meta_info"]
                texts.append(chunk["text"])
                logprobs.add(meta)
                line = {"model": model, "created_at": _now(), **piece(chunk["text"]),
                        **logprobs.new()}
                if meta.get("finish_reason") is not None:
                    line.update(clock.final(meta))
                    line.update(await ending("".join(texts)))
                else:
                    line["done"] = False
                yield _line(line)

        if body.stream:
            return EventStream(lines(), _error_line, media_type="application/x-ndjson")
        texts: list[str] = []
        meta: dict[str, Any] = {}
        async with closed_on_disconnect(request, stream):  # a disconnect ends the loop
            async for chunk in stream:
                clock.output()
                texts.append(chunk["text"])
                meta = chunk["meta_info"]
        text = "".join(texts)
        logprobs.add(meta)
        return {"model": model, "created_at": _now(), **piece(text), **logprobs.new(),
                **clock.final(meta), **await ending(text)}

    async def run_tools(request: Request, body: ChatRequest, prompt: str, prompt_len: int,
                        plan: ToolPlan) -> EventStream | dict[str, Any]:
        clock = _Clock()
        params = _params(body)
        params["max_new_tokens"] = body.window(runtime.context_len).max_new_tokens(
            params.get("max_new_tokens"), prompt_len)
        tool_run = ToolRun(runtime, plan, prompt, params, **_Logprobs.kwargs(body))
        logprobs = _Logprobs(body, tokens)
        model = body.model or model_name
        if body.stream:
            await tool_run.start()  # a refused request is a 400 before the stream starts
            return EventStream(_tool_lines(tool_run, model, clock, logprobs), _error_line,
                               media_type="application/x-ndjson")
        async with closed_on_disconnect(request, tool_run):
            (result,) = await tool_run.results(on_piece=clock.output)
        message: dict[str, Any] = {"role": "assistant", "content": result.text}
        if calls := _tool_calls(result.calls):
            message["tool_calls"] = calls
        logprobs.add(result.meta)
        return {"model": model, "created_at": _now(), "message": message,
                **logprobs.new(), **clock.final(result.meta)}

    def loaded(body: _OllamaRequest, piece: dict[str, Any]) -> dict[str, Any]:
        """Ollama's answer to a request without a prompt: the model is loaded (it always is),
        nothing is generated; one JSON object, streamed or not. It stays loaded while the
        server runs: `keep_alive` 0 (unload) is refused."""
        if _unloads(body.keep_alive):
            raise _cannot(model_name, "unload it (keep_alive 0) while it serves")
        return {"model": body.model or model_name, "created_at": _now(), **piece,
                "done": True, "done_reason": "load"}

    @router.post("/api/generate", response_model=None)
    async def generate(body: GenerateRequest, request: Request) -> Any:
        # Ollama's /api/generate answers a missing model as a model it does not have
        name = served(body.model, APIError(f"model '{body.model or ''}' not found", status=404,
                                           type="not_found_error"))
        _unloads(body.keep_alive)  # a 400 if it is no duration
        if body.raw and (body.template or body.system or body.context):
            raise APIError("raw mode does not support template, system, or context",
                           param="raw")
        if body.template:
            raise APIError("lmnb cannot run Ollama's Go templates (`template`): the model's "
                           "chat template is used; send a prompt templated already with "
                           "raw: true", param="template")
        if body.suffix:
            raise APIError(f'"{name}" does not support insert', param="suffix")
        _no_thinking(body, name)
        if body.images:
            raise _no_images(runtime, "images")
        if not body.prompt:
            return loaded(body, {"response": ""})
        if body.raw:
            prompt = body.prompt
        else:
            messages = [{"role": "system", "content": body.system}] if body.system else []
            prompt = runtime.apply_chat_template(
                messages + [{"role": "user", "content": body.prompt}])
            if body.context:
                before = await asyncio.to_thread(runtime.tokenizer.decode, body.context)
                prompt = strip_added_bos(runtime.tokenizer, before + prompt)
        ids = body.window(runtime.context_len).cut(
            await asyncio.to_thread(runtime.encode, prompt), bos)
        return await run(request, body, prompt, ids, chat=False, context=not body.raw)

    @router.post("/api/chat", response_model=None)
    async def chat(body: ChatRequest, request: Request) -> Any:
        _no_thinking(body, served(body.model))
        _unloads(body.keep_alive)  # a 400 if it is no duration
        if not body.messages:
            return loaded(body, {"message": {"role": "assistant", "content": ""}})
        for i, message in enumerate(body.messages):
            if isinstance(message, dict) and message.get("images"):
                raise _no_images(runtime, f"messages.{i}.images")
        tools = openai_tools(body.tools)
        plan = tool_plan(tools, ToolChoice("auto" if tools else "none"), runtime.tokenizer)
        window = body.window(runtime.context_len)
        prompt, ids = await asyncio.to_thread(
            chat_prompt, chat_messages(body.messages), plan.prompt_tools() if plan else None,
            window)
        fitted = window.cut(ids, bos)
        if plan is not None and body.format in (None, ""):
            if fitted != ids:  # the calls continue the prompt's text: the cut ids' text
                prompt = strip_added_bos(runtime.tokenizer, await asyncio.to_thread(
                    runtime.tokenizer.decode, fitted))
                fitted = await asyncio.to_thread(runtime.encode, prompt)
            return await run_tools(request, body, prompt, len(fitted), plan)
        # with a format, as Ollama: the tools are in the prompt, the reply follows the format
        return await run(request, body, prompt, fitted, chat=True)

    def chat_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    window: Window) -> tuple[str, list[int]]:
        """The prompt of the messages the window holds (the oldest dropped first), and its
        ids."""
        rendered: dict[tuple[int, ...], tuple[str, list[int]]] = {}

        def render(kept: list[dict[str, Any]]) -> tuple[str, list[int]]:
            key = tuple(map(id, kept))
            if key not in rendered:
                text = runtime.apply_chat_template(kept, tools=tools)
                rendered[key] = text, runtime.encode(text)
            return rendered[key]

        return render(window.messages(messages, lambda kept: len(render(kept)[1])))

    checkpoint = Checkpoint.read(runtime.model_dir)
    details = _details(runtime.model_config, checkpoint)
    modified_at = checkpoint.modified_at if checkpoint else _now()
    digest = (checkpoint.digest if checkpoint  # Ollama's CLI prints its first 12 digits
              else hashlib.sha256(model_name.encode()).hexdigest())

    @router.get("/api/tags")
    async def tags() -> dict[str, Any]:
        return {"models": [{"name": model_name, "model": model_name, "modified_at": modified_at,
                            "size": checkpoint.file_bytes if checkpoint else 0, "digest": digest,
                            "details": details}]}

    @router.post("/api/show", response_model=None)
    async def show(body: ShowRequest) -> Any:
        served(body.model or body.name)
        template = runtime.tokenizer.chat_template
        return {"license": "", "modelfile": f"# served by lmnb\nFROM {runtime.model_dir}\n",
                "parameters": f"num_ctx {runtime.context_len}",
                "template": template if isinstance(template, str) else "",
                "details": details, "model_info": _model_info(runtime.model_config, checkpoint),
                "capabilities": ["completion", "tools"], "modified_at": modified_at}

    @router.get("/api/ps")
    async def ps() -> dict[str, Any]:
        memory = (await asyncio.to_thread(runtime.stats)).get("memory", {})
        size = int((memory.get("weights_gb", 0.0) + memory.get("kv_gb", 0.0)) * 2**30)
        return {"models": [{"name": model_name, "model": model_name, "size": size,
                            "digest": digest, "details": details, "expires_at": _NEVER,
                            "size_vram": size if _on_gpu(runtime.engine_config.device) else 0,
                            "context_length": runtime.context_len}]}

    @router.get("/api/version")
    async def version() -> dict[str, str]:
        from lmnb import __version__

        return {"version": __version__}

    @router.post("/api/pull", response_model=None)
    async def pull(body: PullRequest) -> Any:
        """The served model is here already: pulling it succeeds at once."""
        name = body.model or body.name
        if name is None or not name.strip():
            raise APIError("invalid model name", param="model")  # Ollama's words
        if name not in names:
            raise _cannot(model_name, f"pull '{name}'")
        if body.stream:
            return StreamingResponse(iter([_line({"status": "success"})]),
                                     media_type="application/x-ndjson")
        return {"status": "success"}

    for path, methods, what in (
            ("/api/push", ["POST"], "push models"), ("/api/create", ["POST"], "create models"),
            ("/api/copy", ["POST"], "copy models"), ("/api/delete", ["DELETE"], "delete models"),
            ("/api/blobs/{digest}", ["POST", "HEAD"], "take model blobs"),
            ("/api/embed", ["POST"], "compute embeddings (it generates text)"),
            ("/api/embeddings", ["POST"], "compute embeddings (it generates text)")):
        router.add_api_route(path, _refusal(model_name, what), methods=methods)

    return router


def _cannot(model_name: str, what: str) -> APIError:
    return APIError(f"lmnb serves one model, '{model_name}', loaded from its files: it cannot "
                    f"{what}", status=501, type="not_implemented")


def _refusal(model_name: str, what: str) -> Callable[[], Awaitable[None]]:
    """A route that answers every request with `_cannot`'s 501."""
    async def refuse() -> None:
        raise _cannot(model_name, what)

    return refuse


# The model stays loaded until the runtime closes (Ollama's keep_alive < 0).
_NEVER = "9999-12-31T23:59:59Z"


def _on_gpu(device: str) -> bool:
    """`EngineConfig.device` ('auto': cuda when available, as the runtime resolves it)."""
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return device.startswith("cuda")


def _details(config: ModelConfig, checkpoint: Checkpoint | None) -> dict[str, Any]:
    family = config.text_model_type
    return {"parent_model": "", "format": "safetensors", "family": family,
            "families": [family, "clip"] if config.is_multimodal else [family],
            "parameter_size": parameter_size(checkpoint.parameters) if checkpoint else "",
            "quantization_level": checkpoint.dtype if checkpoint else ""}


def _model_info(config: ModelConfig, checkpoint: Checkpoint | None) -> dict[str, Any]:
    """The decoder's shape under GGUF's metadata keys, as Ollama reports them."""
    arch = config.text_model_type
    info: dict[str, Any] = {"general.architecture": arch}
    if checkpoint is not None:
        info["general.parameter_count"] = checkpoint.parameters
    for key, value in (("context_length", config.context_length),
                       ("embedding_length", config.hidden_size),
                       ("block_count", config.num_layers),
                       ("feed_forward_length", config.intermediate_size),
                       ("attention.head_count", config.num_heads),
                       ("attention.head_count_kv", config.num_kv_heads),
                       ("attention.key_length", config.head_dim),
                       ("attention.value_length", config.head_dim),
                       ("attention.layer_norm_rms_epsilon", config.rms_norm_eps),
                       ("rope.freq_base", config.rope_theta),
                       ("vocab_size", config.vocab_size)):
        info[f"{arch}.{key}"] = value
    return info


def _line(value: dict[str, Any]) -> str:
    return json.dumps(value, ensure_ascii=False) + "\n"


def _error_line(error: Exception) -> str:
    return _line({"error": str(error)})


def _tool_calls(calls: list[ParsedCall]) -> list[dict[str, Any]]:
    """Ollama's `message.tool_calls` (arguments as an object) of the whole calls."""
    return [{"function": {"index": i, "name": c.name, "arguments": json.loads(c.arguments)}}
            for i, c in enumerate(c for c in calls if c.complete)]


async def _tool_lines(run: ToolRun, model: str, clock: _Clock,
                      logprobs: _Logprobs) -> AsyncIterator[str]:
    """Content as it comes; the calls, each whole, in one line when the reply ends (as Ollama
    streams them); then the last line."""
    calls = CallStream(run.plan.format)

    def line(message: dict[str, Any], **rest: Any) -> str:
        return _line({"model": model, "created_at": _now(),
                      "message": {"role": "assistant", **message}, **logprobs.new(), **rest})

    async with aclosing(run.pieces()) as pieces:
        async for piece in pieces:
            clock.output()
            logprobs.add(piece.meta)
            calls.feed(piece.calls)
            if piece.text:
                yield line({"content": piece.text}, done=False)
            if piece.done:
                if whole := _tool_calls(calls.calls):
                    yield line({"content": "", "tool_calls": whole}, done=False)
                yield line({"content": ""}, **clock.final(piece.meta))
