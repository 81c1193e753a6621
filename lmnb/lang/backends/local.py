"""Runs programs on an in-process `lmnb.Runtime`."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

from lmnb.lang.backends.base import Generation, ProgramAborted
from lmnb.lang.chat_template import ChatTemplate
from lmnb.lang.ir import GenParams

_SAMPLING_KEYS = ("max_new_tokens", "min_new_tokens", "n", "temperature", "top_p", "top_k",
                  "min_p", "frequency_penalty", "presence_penalty", "ignore_eos", "regex",
                  "json_schema")


class LocalBackend:
    """Backend over a `Runtime` living in this process (the kernel's)."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.chat_template = ChatTemplate(runtime.tokenizer, render=runtime.apply_chat_template)

    def sampling_params(self, params: GenParams) -> dict[str, Any]:
        values = params.set_values()
        sampling = {key: values[key] for key in _SAMPLING_KEYS if key in values}
        if params.stop:
            sampling["stop"] = list(params.stop)
        if params.stop_token_ids:
            sampling["stop_token_ids"] = list(params.stop_token_ids)
        return sampling

    def generate(self, prompt: str, params: GenParams, *,
                 on_delta: Callable[[str], None] | None = None,
                 cancel: threading.Event | None = None) -> Generation:
        n = params.n or 1
        stop_regex = re.compile(params.stop_regex) if params.stop_regex and n == 1 else None
        chunks = self.runtime.generate(
            prompt, self.sampling_params(params), return_logprob=bool(params.return_logprob),
            logprob_start_len=params.logprob_start_len,
            top_logprobs_num=params.top_logprobs_num, stream=True)
        texts = [""] * n
        metas: list[dict[str, Any]] = [{} for _ in range(n)]
        streamed = 0  # characters of texts[0] handed to on_delta
        try:
            for chunk in chunks:
                if cancel is not None and cancel.is_set():
                    raise ProgramAborted("the program was interrupted")
                index = chunk.get("index", 0)
                texts[index] += chunk["text"]
                if chunk["meta_info"].get("finish_reason") is not None:
                    metas[index] = chunk["meta_info"]
                match = stop_regex.search(texts[0]) if stop_regex is not None else None
                if match:
                    texts[0] = texts[0][:match.start()]
                    metas[0] = {**chunk["meta_info"],
                                "finish_reason": {"type": "stop", "matched": match.group()}}
                if n == 1 and on_delta is not None and len(texts[0]) > streamed:
                    on_delta(texts[0][streamed:])
                    streamed = len(texts[0])
                if match:
                    break
        finally:
            chunks.close()  # aborts whatever is still running
        if n == 1:
            return Generation(texts[0], metas[0])
        return Generation(texts, metas)

    def select(self, prompt: str, choices: tuple[str, ...], method: str) -> tuple[str, dict]:
        from lmnb.lang.choices import RuntimeChoiceScorer, select_choice

        result = select_choice(RuntimeChoiceScorer(self.runtime), prompt, choices, method)
        return result.choice, result.meta_info

    def cache_prefix(self, prompt: str) -> None:
        if prompt:
            self.runtime.cache_prefix(prompt)
