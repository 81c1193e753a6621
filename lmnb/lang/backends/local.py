"""Runs programs on an in-process `lmnb.Runtime`."""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from lmnb.lang.backends.base import (
    Backend,
    CancelEvent,
    Generation,
    MediaInput,
    MediaUnsupported,
    ProgramAborted,
    media_data,
)
from lmnb.lang.backends.runtime_gen import GenTexts
from lmnb.lang.backends.submit_chunks import SubmitChunks
from lmnb.lang.backends.turn_tokens import TurnTokens
from lmnb.lang.chat_template import ChatTemplate
from lmnb.lang.event_loop import block_on, run_body
from lmnb.lang.ir import GenParams
from lmnb.lang.prompt_tokens import PromptTokens, prompt_tokens
from lmnb.lang.token_trace import (
    GenRecord,
    TokenTrace,
    TraceLog,
    token_byte_counter,
    traced_top_k,
)
from lmnb.params import SamplingParams
from lmnb.runtime.encoded_submit import EncodedSubmitter
from lmnb.runtime.output.logprob_text import TokenTexts, with_token_texts

if TYPE_CHECKING:
    from lmnb.lang.choices import ScoringRuntime
    from lmnb.runtime.surface import EngineSurface

_CANCEL_POLL_S = 0.05  # a cancelled program aborts its requests within this, even unadmitted
_IDLE_POLL_S = 1.0  # ... where a `CancelEvent` closes the stream itself: a safety net only


@functools.lru_cache(maxsize=1024)
def _sampling_dict(params: GenParams) -> dict[str, Any]:
    return params.sampling_params().to_dict()


@functools.lru_cache(maxsize=1024)
def _parsed_params(params: GenParams) -> SamplingParams:
    """One shared `SamplingParams` per distinct merged `params` (requests never mutate it)."""
    return params.sampling_params()


def parsed_params(params: GenParams) -> SamplingParams:
    """The request's `SamplingParams` of a gen's merged `params` (raises `InvalidRequestError`
    naming a bad value), parsed once per distinct `params`."""
    try:
        return _parsed_params(params)
    except TypeError:  # a value that cannot be hashed (a dict, a list)
        return params.sampling_params()


class AwaitedRuntime:
    """A runtime as the choice scorer calls it (`encode`, `tokenizer`, a blocking `generate`,
    `cache_prefix`), from a greenlet on the program loop: each `generate` is submitted as a
    stream and awaited there (`block_on` suspends the greenlet), so no thread waits on it."""

    def __init__(self, runtime: EngineSurface, *, submits: SubmitChunks) -> None:
        self.runtime = runtime
        self.tokenizer = runtime.tokenizer
        self.submits = submits

    def encode(self, text: str) -> list[int]:
        return self.runtime.encode(text)

    def generate(self, prompt: Any = None, sampling_params: Any = None, *,
                 input_ids: Any = None, **options: Any) -> Any:
        with self.submits.submitting():
            stream = self.runtime.generate(prompt, sampling_params, input_ids=input_ids,
                                           stream=True, **options)
        results = block_on(stream.aresults())
        batch = isinstance(prompt, list) or (
            isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list))
        return results if batch or len(results) != 1 else results[0]

    def cache_prefix(self, prompt: str | None = None, *,
                     input_ids: Sequence[int] | None = None) -> int:
        out = self.generate(prompt, {"max_new_tokens": 0},
                            input_ids=None if input_ids is None else list(input_ids))
        return out["meta_info"]["prompt_tokens"]


class LocalBackend:
    """Backend over a `Runtime` living in this process (the kernel's). A LLaVA runtime also takes
    `image()` / `video()`: each is loaded, hashed and preprocessed once by the runtime's
    `MediaProcessor`, and the prepared item is sent with every request whose prompt holds it."""

    is_chat_model = False  # programs send text; roles are rendered with the model's template
    reports_token_texts = False
    streams_meta_info = True  # `generate` takes `on_meta=`

    def __init__(self, runtime: EngineSurface) -> None:
        self.runtime = runtime
        self.chat_template = ChatTemplate(runtime.tokenizer, render=runtime.apply_chat_template)
        # Prompts go to the runtime as ids, tokenized incrementally (exactly the ids of the
        # runtime's `encode`, its tokenizer's own), when its tokenizer is a fast one.
        self.prompt_tokens: PromptTokens | None = prompt_tokens(runtime.tokenizer)
        # The program loop's streamed requests, sent to the scheduler in growing chunks.
        self.submits = SubmitChunks(runtime.batched_submits)
        # Text prompts' ids and parsed parameters go straight in (`Runtime.submit_encoded`).
        self.encoded_submitter: EncodedSubmitter | None = (
            runtime if self.prompt_tokens is not None and isinstance(runtime, EncodedSubmitter)
            else None)
        # On the program loop, the prompts of one turn are tokenized together.
        self.turn_tokens = (TurnTokens(self.prompt_tokens) if self.prompt_tokens is not None
                            else None)

    def _prompt(self, prompt: str, media: Sequence[MediaInput]) -> dict[str, Any]:
        """`generate`'s prompt arguments: `input_ids=` of a text prompt, else the text."""
        if self.prompt_tokens is None or media:
            return {"prompt": prompt, **media_data(media)}
        return {"input_ids": self.prompt_tokens.encode(prompt)}

    def sampling_params(self, params: GenParams) -> dict[str, Any]:
        """`Runtime.generate`'s `sampling_params` of a gen's merged `params`: every field of
        their `SamplingParams` (checked here, so a bad value fails before any request). The
        runtime copies the dict; it is computed once per distinct `params`."""
        try:
            return _sampling_dict(params)
        except TypeError:  # a value that cannot be hashed (a dict, a list)
            return params.sampling_params().to_dict()

    # ---- media -------------------------------------------------------------------------------
    def prepare_media(self, kind: str, source: Any, *,
                      num_frames: int | None = None) -> MediaInput:
        token = self.runtime.image_token if kind == "image" else self.runtime.video_token
        processor = self.runtime.media_processor
        if token is None or processor is None:  # a text model
            raise MediaUnsupported(f"{self.runtime.model_dir.name} takes no {kind}s")
        if kind == "image":
            item = processor.image(source)
        else:
            item = processor.video(source, num_frames) if num_frames else processor.video(source)
        return MediaInput(kind, token, item)

    def media_token_ids(self) -> frozenset[int]:
        processor = self.runtime.media_processor
        if processor is None:
            return frozenset()
        ids = (processor.image_token_id, processor.video_token_id)
        return frozenset(i for i in ids if i is not None)

    # ---- Backend -----------------------------------------------------------------------------
    def _encoded_submit(self, media: Sequence[MediaInput]) -> bool:
        """A gen's request goes in as ids through `submit_encoded`."""
        return self.encoded_submitter is not None and self.prompt_tokens is not None and not media

    def _submit(self, prompt: str, params: GenParams, media: Sequence[MediaInput],
                trace: TokenTrace | None, *, whole: bool = False,
                ids: list[int] | None = None) -> tuple[Any, GenRecord | None]:
        """Submits one gen's request(s); their `OutputStream`, consumed by a thread or a task,
        and with `trace` (a traced program) the new record of it that the first sample's
        tokens, origins and logprobs go to. `whole`: the stream brings one whole chunk per
        request at its end (nobody takes the text as it comes, and nothing is traced). `ids`:
        the prompt's, already encoded (`_encoded_submit` only)."""
        if self.encoded_submitter is not None and self.prompt_tokens is not None and not media:
            if ids is None:
                ids = self.prompt_tokens.encode(prompt)
            record = trace.request(ids, len(prompt)) if trace is not None else None
            chunks = self.encoded_submitter.submit_encoded(
                ids, parsed_params(params), return_logprob=bool(params.return_logprob),
                logprob_start_len=params.logprob_start_len,
                top_logprobs_num=traced_top_k(params.top_logprobs_num, record is not None),
                return_token_origins=record is not None,
                incremental=record is not None or not whole)
            return chunks, record
        prompt_args = self._prompt(prompt, media)
        record = (trace.request(prompt_args["input_ids"], len(prompt))
                  if trace is not None and "input_ids" in prompt_args else None)
        options: dict[str, Any] = {}
        if record is not None:
            options["return_token_origins"] = True
        elif whole:
            options["incremental"] = False
        chunks = self.runtime.generate(
            sampling_params=self.sampling_params(params),
            return_logprob=bool(params.return_logprob),
            logprob_start_len=params.logprob_start_len,
            top_logprobs_num=traced_top_k(params.top_logprobs_num, record is not None),
            stream=True, **options, **prompt_args)
        return chunks, record

    def _generation(self, gen: GenTexts, params: GenParams) -> Generation:
        if params.return_text_in_logprobs:
            texts = TokenTexts(self.runtime.tokenizer)
            gen.metas = [with_token_texts(meta, texts) for meta in gen.metas]
        return gen.generation()

    @staticmethod
    def _take(gen: GenTexts, record: GenRecord | None, chunk: dict[str, Any]) -> bool:
        """One streamed chunk into the gen's texts (and the trace's record); True once every
        sample is complete (the stream has nothing more)."""
        index = chunk.get("index", 0)
        cut = gen.update(index, gen.texts[index] + chunk["text"], chunk["meta_info"])
        if record is not None and index == 0:
            record.update(chunk, len(gen.texts[0]))
        return cut or gen.complete

    @staticmethod
    def _end(chunks: Any, record: GenRecord | None,
             unregister: Callable[[], None] | None) -> None:
        """A gen's stream is done with (finished, failed or cancelled): its trace record closes,
        the cancel hook goes, and the stream closes, aborting whatever still runs."""
        if record is not None and not record.done:
            record.close()
        if unregister is not None:
            unregister()
        chunks.close()

    async def agenerate(self, prompt: str, params: GenParams, *,
                        on_delta: Callable[[str], None] | None = None,
                        on_meta: Callable[[dict[str, Any]], None] | None = None,
                        cancel: threading.Event | None = None,
                        media: Sequence[MediaInput] = (),
                        trace: TokenTrace | None = None) -> Generation:
        """`generate` as a coroutine (the program loop's): the request goes straight into the
        runtime and its output stream is awaited; setting `cancel` (a `CancelEvent`) closes the
        stream, which aborts the request and wakes the await. `trace` as in `generate`."""
        ids = (await self.turn_tokens.encode(prompt)
               if self.turn_tokens is not None and self._encoded_submit(media) else None)
        if cancel is not None and cancel.is_set():  # interrupted while it was tokenized
            raise ProgramAborted("the program was interrupted")
        with self.submits.submitting():
            chunks, record = self._submit(prompt, params, media, trace, whole=on_delta is None,
                                          ids=ids)
        gen = GenTexts(params, on_delta, on_meta)
        unregister = cancel.on_set(chunks.close) if isinstance(cancel, CancelEvent) else None
        try:
            async for chunk in chunks:
                if cancel is not None and cancel.is_set():
                    break
                if self._take(gen, record, chunk):
                    break
            if cancel is not None and cancel.is_set():
                raise ProgramAborted("the program was interrupted")
        finally:
            self._end(chunks, record, unregister)
        return self._generation(gen, params)

    def generate(self, prompt: str, params: GenParams, *,
                 on_delta: Callable[[str], None] | None = None,
                 on_meta: Callable[[dict[str, Any]], None] | None = None,
                 cancel: threading.Event | None = None,
                 media: Sequence[MediaInput] = (),
                 trace: TokenTrace | None = None) -> Generation:
        """`Backend.generate`; with `trace` (a traced program), the request's tokens, origins
        and logprobs go to a new record of it."""
        chunks, record = self._submit(prompt, params, media, trace)
        gen = GenTexts(params, on_delta, on_meta)
        wakes = isinstance(cancel, CancelEvent)
        # Setting the cancel event closes the stream, which wakes the wait below.
        unregister = cancel.on_set(chunks.close) if wakes else None
        poll = _IDLE_POLL_S if wakes else _CANCEL_POLL_S
        try:
            while True:
                if cancel is not None and cancel.is_set():
                    raise ProgramAborted("the program was interrupted")
                try:
                    chunk = chunks.get(timeout=poll)
                except queue.Empty:
                    continue
                if chunk is None:
                    if cancel is not None and cancel.is_set():
                        raise ProgramAborted("the program was interrupted")
                    break
                if self._take(gen, record, chunk):
                    break
        finally:
            self._end(chunks, record, unregister)
        return self._generation(gen, params)

    async def aselect(self, prompt: str, choices: tuple[str, ...], method: str, *,
                      media: Sequence[MediaInput] = ()) -> tuple[str, dict]:
        """`select` on the program loop: the scoring (several runtime calls in turn) runs as a
        greenlet whose calls are submitted as streams and awaited (`AwaitedRuntime`)."""
        return await run_body(self._select, AwaitedRuntime(
            self.runtime, submits=self.submits), prompt, choices, method, media)

    async def acache_prefix(self, prompt: str, *, media: Sequence[MediaInput] = ()) -> None:
        """`cache_prefix` as a coroutine: a prefill-only request, its stream awaited."""
        if not prompt:
            return
        with self.submits.submitting():
            if media:
                stream = self.runtime.generate(prompt, {"max_new_tokens": 0}, stream=True,
                                               **media_data(media))
            elif self.prompt_tokens is not None:
                stream = self.runtime.generate(input_ids=self.prompt_tokens.encode(prompt),
                                               sampling_params={"max_new_tokens": 0},
                                               stream=True)
            else:
                stream = self.runtime.generate(prompt, {"max_new_tokens": 0}, stream=True)
        async for _ in stream:  # a runtime's wrapper may stream without `aresults`
            pass

    def select(self, prompt: str, choices: tuple[str, ...], method: str, *,
               media: Sequence[MediaInput] = ()) -> tuple[str, dict]:
        return self._select(self.runtime, prompt, choices, method, media)

    def _select(self, runtime: ScoringRuntime, prompt: str, choices: tuple[str, ...], method: str,
                media: Sequence[MediaInput]) -> tuple[str, dict]:
        from lmnb.lang.choices import RuntimeChoiceScorer, select_choice

        scorer = RuntimeChoiceScorer(runtime, media=media_data(media),
                                     media_token_ids=self.media_token_ids() if media else
                                     frozenset())
        result = select_choice(scorer, prompt, choices, method)
        return result.choice, result.meta_info

    def cache_prefix(self, prompt: str, *, media: Sequence[MediaInput] = ()) -> None:
        if not prompt:
            return
        if media:
            self.runtime.generate(prompt, {"max_new_tokens": 0}, **media_data(media))
        elif self.prompt_tokens is not None:
            self.runtime.cache_prefix(input_ids=self.prompt_tokens.encode(prompt))
        else:
            self.runtime.cache_prefix(prompt)

    def pin_prefix(self, prompt: str) -> int:
        """Caches `prompt` and keeps it cached until `unpin_prefix` (`Runtime.pin_prefix`)."""
        return self.runtime.pin_prefix(prompt)

    def unpin_prefix(self, pin: int) -> bool:
        return self.runtime.unpin_prefix(pin)


    # ---- SGLang's backend calls (`lmnb.flush_cache()`, `lmnb.get_server_info()`) ----------------
    def flush_cache(self) -> bool:
        """Empties the runtime's prefix cache; False while requests are running or waiting."""
        return self.runtime.flush_cache()

    def get_server_info(self) -> dict[str, Any]:
        """The runtime's settings and live statistics, in the shape of SGLang's
        `/get_server_info` (the engine options, `max_total_num_tokens`, `internal_states`)."""
        import dataclasses

        from lmnb import __version__

        runtime = self.runtime
        return {**dataclasses.asdict(runtime.engine_config), "version": __version__,
                "model_path": str(runtime.model_dir),
                "max_total_num_tokens": runtime.max_total_tokens,
                "context_length": runtime.context_len,
                "internal_states": [runtime.stats()]}


def start_trace(backend: Backend) -> TokenTrace:
    """The root trace of a run on `backend`, which must run on an in-process runtime (the
    trace reads its token ids and the runtime's token origins)."""
    if not isinstance(backend, LocalBackend):
        raise ValueError(f"token_view needs a program run on an in-process runtime "
                         f"(LocalBackend); {type(backend).__name__} does not report tokens")
    tokenizer = backend.runtime.tokenizer
    texts = TokenTexts(tokenizer)
    return TokenTrace(TraceLog(texts, token_byte_counter(tokenizer, texts)),
                      runtime=backend.runtime)
