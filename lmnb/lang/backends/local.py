"""Runs programs on an in-process `lmnb.Runtime`."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from lmnb.lang.backends.base import (
    CancelEvent,
    Generation,
    MediaInput,
    MediaUnsupported,
    ProgramAborted,
    media_data,
)
from lmnb.lang.backends.runtime_gen import GenTexts
from lmnb.lang.chat_template import ChatTemplate
from lmnb.lang.ir import GenParams
from lmnb.lang.prompt_tokens import PromptTokens, prompt_tokens
from lmnb.lang.token_trace import TokenTrace, traced_top_k
from lmnb.runtime.output.logprob_text import TokenTexts, with_token_texts

_CANCEL_POLL_S = 0.05  # a cancelled program aborts its requests within this, even unadmitted
_IDLE_POLL_S = 1.0  # ... where a `CancelEvent` closes the stream itself: a safety net only


class LocalBackend:
    """Backend over a `Runtime` living in this process (the kernel's). A LLaVA runtime also takes
    `image()` / `video()`: each is loaded, hashed and preprocessed once by the runtime's
    `MediaProcessor`, and the prepared item is sent with every request whose prompt holds it."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.chat_template = ChatTemplate(runtime.tokenizer, render=runtime.apply_chat_template)
        # Prompts go to the runtime as ids, tokenized incrementally (exactly the runtime's ids),
        # when the runtime tokenizes with its tokenizer's own `encode` (a `Runtime` does).
        self.prompt_tokens: PromptTokens | None = (
            prompt_tokens(runtime.tokenizer) if callable(getattr(runtime, "encode", None))
            else None)

    def _prompt(self, prompt: str, media: Sequence[MediaInput]) -> dict[str, Any]:
        """`generate`'s prompt arguments: `input_ids=` of a text prompt, else the text."""
        if self.prompt_tokens is None or media:
            return {"prompt": prompt, **media_data(media)}
        return {"input_ids": self.prompt_tokens.encode(prompt)}

    def sampling_params(self, params: GenParams) -> dict[str, Any]:
        """`Runtime.generate`'s `sampling_params` of a gen's merged `params`: every field of
        their `SamplingParams` (checked here, so a bad value fails before any request)."""
        return params.sampling_params().to_dict()

    # ---- media -------------------------------------------------------------------------------
    def prepare_media(self, kind: str, source: Any, *,
                      num_frames: int | None = None) -> MediaInput:
        token = getattr(self.runtime, f"{kind}_token", None)  # None: a text model
        if token is None:
            model = getattr(getattr(self.runtime, "model_dir", None), "name", None) or "the model"
            raise MediaUnsupported(f"{model} takes no {kind}s")
        processor = self.runtime.media_processor
        if kind == "image":
            item = processor.image(source)
        else:
            item = processor.video(source, num_frames) if num_frames else processor.video(source)
        return MediaInput(kind, token, item)

    def media_token_ids(self) -> frozenset[int]:
        processor = getattr(self.runtime, "media_processor", None)
        ids = (getattr(processor, f"{kind}_token_id", None) for kind in ("image", "video"))
        return frozenset(i for i in ids if i is not None)

    # ---- Backend -----------------------------------------------------------------------------
    def generate(self, prompt: str, params: GenParams, *,
                 on_delta: Callable[[str], None] | None = None,
                 cancel: threading.Event | None = None,
                 media: Sequence[MediaInput] = (),
                 trace: TokenTrace | None = None) -> Generation:
        """`Backend.generate`; with `trace` (a traced program), the request's tokens, origins
        and logprobs go to a new record of it."""
        prompt_args = self._prompt(prompt, media)
        record = (trace.request(prompt_args["input_ids"], len(prompt))
                  if trace is not None and "input_ids" in prompt_args else None)
        chunks = self.runtime.generate(
            sampling_params=self.sampling_params(params),
            return_logprob=bool(params.return_logprob),
            logprob_start_len=params.logprob_start_len,
            top_logprobs_num=traced_top_k(params.top_logprobs_num, record is not None),
            stream=True, **({"return_token_origins": True} if record is not None else {}),
            **prompt_args)
        gen = GenTexts(params, on_delta)
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
                index = chunk.get("index", 0)
                complete = gen.update(index, gen.texts[index] + chunk["text"], chunk["meta_info"])
                if record is not None and index == 0:
                    record.update(chunk, len(gen.texts[0]))
                if complete:
                    break
        finally:
            if record is not None and not record.done:
                record.close()
            if unregister is not None:
                unregister()
            chunks.close()  # aborts whatever is still running
        if params.return_text_in_logprobs:
            texts = TokenTexts(self.runtime.tokenizer)
            gen.metas = [with_token_texts(meta, texts) for meta in gen.metas]
        return gen.generation()

    def select(self, prompt: str, choices: tuple[str, ...], method: str, *,
               media: Sequence[MediaInput] = ()) -> tuple[str, dict]:
        from lmnb.lang.choices import RuntimeChoiceScorer, select_choice

        scorer = RuntimeChoiceScorer(self.runtime, media=media_data(media),
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
                "model_path": str(getattr(runtime, "model_dir", "")),
                "max_total_num_tokens": getattr(runtime, "max_total_tokens", None),
                "context_length": getattr(runtime, "context_len", None),
                "internal_states": [runtime.stats()]}
