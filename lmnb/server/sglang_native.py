"""SGLang's native API over the runtime, field for field: `/generate`, `/abort_request`,
`/model_info`, `/server_info` (and their older names `/get_model_info`, `/get_server_info`; SGLang
0.5's frontend reads `/server_info`), `/flush_cache`, `/start_profile`, `/stop_profile`,
`/health`, `/health_generate`, and `/concate_and_append_request` (SGLang's frontend's
`join("concate_and_append")`: a no-op here, the joined text is sent next).

`/generate` streams like SGLang's default: every event carries the text and ids so far
(cumulative), `meta_info` with SGLang's per-chunk fields (`streamed_meta`: the counts and the
logprob lists so far), `index` for batch requests, then
`data: [DONE]`. Logprobs are `[logprob, token_id, text or None]` triples (text with
`return_text_in_logprobs`); `max_new_tokens` 0 with `top_logprobs_num` k gives one
`output_top_logprobs` row, the next token's top k (and with `token_ids_logprob` one
`output_token_ids_logprobs` row: those ids' logprobs, SGLang's scoring); the prompt's lists
from `logprob_start_len` have None at their first position, as SGLang's. In a batch,
`return_logprob`, `logprob_start_len`, `top_logprobs_num` and `token_ids_logprob` take one value
for every prompt or a list with one per prompt (SGLang's). `sampling_params`
takes every name of SGLang 0.5's (`lmnb.params`): unimplemented ones only with their defaults,
else a 400 naming them; so do the request's fields lmnb does not implement (`input_embeds`,
`audio_data`, `lora_path`, `custom_logit_processor`, `session_params`, `return_hidden_states`,
`return_routed_experts`, `return_entropy`), where ignoring them would answer another question.

`rid` names the requests as SGLang does: a string is the id of a single request (`rid_i` for
each result of a batch or of `n` > 1), a list has one id per prompt (`rid_k` for sample k with
`n` > 1); `meta_info.id` reports it, and `/abort_request {"rid"}` (or `{"abort_all": true}`)
ends the request with finish_reason `abort`."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from fastapi import APIRouter, Request, Response
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from lmnb.runtime.output.logprob_lists import PROMPT_LISTS
from lmnb.runtime.output.logprob_text import TokenTexts, with_token_texts
from lmnb.runtime.output.stream import OutputStream, extend_output_ids
from lmnb.server.errors import APIError
from lmnb.server.media import media_kwargs, media_tokens
from lmnb.server.open_requests import OpenRequests, caller_ids
from lmnb.server.request_streams import HandledRequests
from lmnb.server.streamed_meta import StreamedMeta
from lmnb.server.streams import (
    Chunk,
    EventStream,
    ServedRuntime,
    chunk_index,
    chunks,
    collect,
    open_stream,
    sse,
    sse_error,
)


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    # one value for every prompt, or (a batch) one per prompt
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int | None] | None = None
    top_logprobs_num: int | list[int | None] | None = None
    # ids for every prompt, or one list per prompt; the runtime checks them (a 400 naming the bad
    # value, where a typed field would coerce "3" or 3.0)
    token_ids_logprob: list[Any] | None = None
    return_text_in_logprobs: bool = False
    return_token_origins: bool = False  # lmnb's: where each token came from (token_origins.py)
    rid: str | list[str] | None = None
    require_reasoning: bool = False  # SGLang's: count reasoning_tokens; lmnb separates none
    image_data: Any = None  # per prompt one item or a list: path, data: URL or base64
    video_data: Any = None
    # SGLang's, which lmnb does not implement: only with their defaults (`check_implemented`)
    input_embeds: Any = None
    audio_data: Any = None
    lora_path: Any = None
    custom_logit_processor: Any = None
    session_params: Any = None
    return_hidden_states: Any = False
    return_routed_experts: bool = False
    return_entropy: bool = False

    def check_implemented(self) -> None:
        """A 400 naming an SGLang field lmnb would otherwise drop, answering as if it were not
        given (another model's output, or a meta_info without what was asked)."""
        for name in _NOT_IMPLEMENTED:
            value = getattr(self, name)
            if any(value) if isinstance(value, list) else value:  # a list: one per prompt
                raise APIError(f"{name}: not implemented by lmnb's /generate", param=name)

    def prompts(self) -> int:
        data = self.text if self.text is not None else self.input_ids
        batch = isinstance(data, list) and bool(data) and isinstance(data[0], list | str)
        return len(data) if batch and isinstance(data, list) else 1

    def samples(self) -> list[int]:
        """Results per prompt (`n`); read once the runtime has accepted the parameters."""
        params = self.sampling_params
        per = params if isinstance(params, list) else [params] * self.prompts()
        return [int(p.get("n") or 1) if isinstance(p, dict) else 1 for p in per]


_NOT_IMPLEMENTED = ("input_embeds", "audio_data", "lora_path", "custom_logit_processor",
                    "session_params", "return_hidden_states", "return_routed_experts",
                    "return_entropy")


class ProfileRequest(BaseModel):
    """SGLang's `ProfileReqInput`; `start_step`, `profile_by_stage` and `merge_profiles` only
    with their defaults."""

    model_config = ConfigDict(extra="ignore")
    output_dir: str | None = None
    num_steps: int | None = None
    activities: list[str] | None = None
    with_stack: bool | None = None
    record_shapes: bool | None = None
    start_step: int | None = None
    profile_by_stage: bool = False
    merge_profiles: bool = False

    def check_implemented(self) -> None:
        asked = [name for name, value in (("start_step", self.start_step is not None),
                                          ("profile_by_stage", self.profile_by_stage),
                                          ("merge_profiles", self.merge_profiles)) if value]
        if asked:
            raise APIError(f"{', '.join(asked)}: not implemented by lmnb's profiler",
                           param=asked[0])


@runtime_checkable
class Profiled(Protocol):
    """A runtime that traces its forward passes (`Runtime`; not a data-parallel one)."""

    def start_profile(self, output_dir: str | None = None, *, num_steps: int | None = None,
                      activities: Sequence[str] | None = None, with_stack: bool | None = None,
                      record_shapes: bool | None = None) -> Path: ...

    def stop_profile(self) -> Path: ...


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    rid: str = ""
    abort_all: bool = False


class ConcateAndAppendRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    src_rids: list[str]
    dst_rid: str


def _aborted(meta: dict[str, Any], rid: str, output_ids: list[int]) -> dict[str, Any]:
    """The last meta_info of a request ended by `/abort_request` (its stream was closed)."""
    return {**meta, "id": rid, "finish_reason": {"type": "abort", "message": "aborted"},
            "completion_tokens": len(output_ids)}


def sglang_meta(meta: dict[str, Any], token_text: TokenTexts | None) -> dict[str, Any]:
    """The runtime's meta_info with logprobs as SGLang's triples (text None unless
    `token_text` is given), the first prompt position unscored (`_unscored_first_position`)."""
    return _unscored_first_position(with_token_texts(meta, token_text or _no_text))


def _unscored_first_position(meta: dict[str, Any]) -> dict[str, Any]:
    """SGLang's scheduler scores the prompt positions after `logprob_start_len` only: the first
    position returned has no logprob whatever the start (lmnb's runtime scores it when the start
    is past 0). SGLang's frontend `select` averages the non-None values of lists it asks from
    two tokens before the prompt's end, so the same None gives the same scores."""
    lists = meta.get("input_token_logprobs")
    if not lists:
        return meta
    out = dict(meta)
    first = lists[0]
    out["input_token_logprobs"] = [(None, *first[1:]), *lists[1:]]
    for key in PROMPT_LISTS[1:]:  # rows: the first row None
        if out.get(key):
            out[key] = [None, *out[key][1:]]
    return out


def _no_text(token_id: int) -> None:
    return None


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def make_router(runtime: ServedRuntime, model_name: str, open_requests: OpenRequests,
                handled: HandledRequests) -> APIRouter:
    """The native routes; `/abort_request` finds a rid in `open_requests` (the OpenAI routes'
    too), and aborts every API's requests with `abort_all` (`handled`)."""
    router = APIRouter()
    token_text = TokenTexts(runtime.tokenizer)

    @router.post("/generate", response_model=None)
    async def generate(body: GenerateRequest, request: Request) -> Any:
        body.check_implemented()
        if (body.text is None) == (body.input_ids is None):
            raise APIError("give exactly one of text or input_ids", param="text")
        batch = isinstance(body.text, list) or bool(
            body.input_ids and isinstance(body.input_ids[0], list))
        if body.require_reasoning:
            raise APIError("require_reasoning: lmnb does not separate reasoning (meta_info "
                           "reasoning_tokens is 0)", param="require_reasoning")
        if isinstance(body.rid, list) and len(body.rid) != body.prompts():
            raise APIError(f"rid has {len(body.rid)} ids for {body.prompts()} prompts",
                           param="rid")
        stream = await open_stream(
            runtime, body.text, body.sampling_params, input_ids=body.input_ids,
            return_logprob=body.return_logprob, logprob_start_len=body.logprob_start_len,
            top_logprobs_num=body.top_logprobs_num, token_ids_logprob=body.token_ids_logprob,
            **({"return_token_origins": True} if body.return_token_origins else {}),
            **media_kwargs(body.image_data, body.video_data),
            # unstreamed: one whole result per request, as `Runtime.generate` returns it (a
            # stop_regex cut can take back text that an incremental stream has delivered)
            incremental=body.stream)
        texts = token_text if body.return_text_in_logprobs else None
        ids = ([str(rid) for rid in stream.rids] if body.rid is None
               else caller_ids(body.rid, body.samples()))
        if body.stream:
            events = _events(stream, batch, texts, ids, runtime.engine_config.weight_version)
            return EventStream(open_requests.tracked_events(ids, stream, events), sse_error,
                               media_type="text/event-stream")
        with open_requests.tracked(ids, stream):
            results = await collect(request, stream)
        results = [{**r, "meta_info": {**sglang_meta(r["meta_info"], texts), "id": rid}
                    if r["meta_info"].get("finish_reason") is not None
                    else _aborted(r["meta_info"], rid, r["output_ids"])}
                   for r, rid in zip(results, ids, strict=True)]
        return results if batch or len(results) > 1 else results[0]

    @router.post("/abort_request")
    async def abort_request(body: AbortRequest) -> Response:
        """Aborts the request `rid` (of `/generate`, or an OpenAI route's given that `rid`; with
        `abort_all`, every request of every route, tool calls' included); an unknown or
        finished rid is a no-op, as in SGLang."""
        if body.abort_all:
            handled.abort_all()
        elif body.rid:
            open_requests.abort(body.rid)
        return Response(status_code=200)

    @router.api_route("/concate_and_append_request", methods=["GET", "POST"])
    async def concate_and_append_request(body: ConcateAndAppendRequest) -> Response:
        """SGLang's frontend calls it on `forks.join("concate_and_append")` (its default
        `enable_parallel_encoding`; SGLang 0.5's server has no such route): the forks' KV is
        not spliced into the parent here; the parent's next request sends the joined text,
        whose prefix the radix cache matches, so the program gets what the text join gives."""
        return Response(status_code=200)

    @router.get("/model_info")
    @router.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        config = runtime.model_config
        return {"model_path": str(runtime.model_dir), "tokenizer_path": str(runtime.model_dir),
                "served_model_name": model_name, "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": runtime.engine_config.weight_version,
                "has_image_understanding": config.image_token_id is not None,
                **media_tokens(runtime),
                "has_audio_understanding": False, "model_type": config.model_type,
                "architectures": [config.architecture] if config.architecture else None}

    @router.get("/server_info")
    @router.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        stats = await asyncio.to_thread(runtime.stats)
        from lmnb import __version__

        return _jsonable({**dataclasses.asdict(runtime.engine_config),
                          "served_model_name": model_name, "version": __version__,
                          "max_total_num_tokens": runtime.max_total_tokens,
                          "context_length": runtime.context_len, "internal_states": [stats]})

    @router.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if await asyncio.to_thread(runtime.flush_cache):
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse("Cache not flushed: requests are running or waiting.\n",
                                 status_code=400)

    def profiled() -> Profiled:
        if not isinstance(runtime, Profiled):
            raise APIError("profiling traces one runtime's passes; this server runs a "
                           "data-parallel runtime")
        return runtime

    @router.api_route("/start_profile", methods=["GET", "POST"])
    async def start_profile(body: ProfileRequest | None = None) -> Response:
        """Traces the forward passes until `/stop_profile` or `num_steps` passes; the answer
        names the trace's directory. A profile already running is a 400."""
        body = body or ProfileRequest()
        body.check_implemented()
        directory = await asyncio.to_thread(
            profiled().start_profile, body.output_dir, num_steps=body.num_steps,
            activities=body.activities, with_stack=body.with_stack,
            record_shapes=body.record_shapes)
        return PlainTextResponse(f"Start profiling. Traces will be saved to: {directory}\n")

    @router.api_route("/stop_profile", methods=["GET", "POST"])
    async def stop_profile() -> Response:
        """Writes the trace; a 400 when no profile runs (SGLang: a 500 with the same words)."""
        trace = await asyncio.to_thread(profiled().stop_profile)
        return PlainTextResponse(f"Stop profiling. Trace saved to: {trace}\n")

    @router.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @router.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        try:
            stream = await open_stream(runtime, None, {"max_new_tokens": 1, "temperature": 0},
                                       input_ids=[0])
            await collect(request, stream)
        except Exception:  # a failed or closed runtime
            return Response(status_code=503)
        return Response(status_code=200)

    return router


async def _events(stream: OutputStream, batch: bool, token_text: TokenTexts | None,
                  rids: list[str], weight_version: str) -> AsyncGenerator[str, None]:
    """Cumulative events, each with SGLang's meta_info so far (`StreamedMeta`); a request whose
    stream closed before its last chunk gets a last event with finish_reason `abort` (one
    aborted by `/abort_request` gets the runtime's)."""
    texts: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    metas: dict[int, dict[str, Any]] = {}
    so_far: dict[int, StreamedMeta] = {}
    finished: set[int] = set()
    tagged = batch or len(rids) > 1  # as the runtime tags a stream's chunks

    def event(index: int, meta: dict[str, Any]) -> str:
        out: Chunk = {"text": texts.get(index, ""), "output_ids": list(ids.get(index, [])),
                      "meta_info": meta}
        if tagged:
            out["index"] = index
        return sse(out)

    async for chunk in chunks(stream):
        index = chunk_index(chunk)
        texts[index] = texts.get(index, "") + chunk["text"]
        extend_output_ids(ids.setdefault(index, []), chunk)
        progress = so_far.setdefault(index, StreamedMeta(weight_version))
        meta = {**sglang_meta(progress.add(chunk["meta_info"]), token_text), "id": rids[index]}
        metas[index] = meta
        if meta.get("finish_reason") is not None:
            finished.add(index)
        yield event(index, meta)
    for index, rid in enumerate(rids):
        if index not in finished:
            yield event(index, _aborted(metas.get(index, {}), rid, ids.get(index, [])))
    yield sse("[DONE]")
