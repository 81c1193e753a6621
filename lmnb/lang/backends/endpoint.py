"""`RuntimeEndpoint(url)`: runs programs on an lmnb or SGLang server through SGLang's native
routes (`/generate`, `/get_model_info`, `/get_server_info`, `/flush_cache`), as SGLang's backend
of the same name does.

    lmnb.set_default_backend(lmnb.RuntimeEndpoint("http://127.0.0.1:30000"))

The model's tokenizer (for role text and `select` scoring) is loaded from the `model_path` the
server reports, so the server must run on this machine or share its model folder."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

from lmnb.lang.backends.base import Generation, ProgramAborted
from lmnb.lang.backends.runtime_gen import GenTexts, runtime_sampling_params
from lmnb.lang.chat_template import ChatTemplate
from lmnb.lang.ir import GenParams


class RuntimeEndpoint:
    """Backend over a server's SGLang-native API."""

    def __init__(self, base_url: str, api_key: str | None = None, *,
                 timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self.model_info: dict[str, Any] = self._request("/get_model_info")
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_info["tokenizer_path"])
        self.chat_template = ChatTemplate(self.tokenizer)

    # ---- HTTP ------------------------------------------------------------------------------------
    def _open(self, route: str, body: dict[str, Any] | None = None) -> Any:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url + route, data=data, headers=headers,
                                         method="GET" if body is None else "POST")
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as error:
            raise RuntimeError(f"{route}: HTTP {error.code}: "
                               f"{error.read().decode(errors='replace')}") from None

    def _request(self, route: str, body: dict[str, Any] | None = None) -> Any:
        with self._open(route, body) as response:
            return json.loads(response.read())

    def _events(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        with self._open("/generate", {**body, "stream": True}) as response:
            for line in response:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    return
                event = json.loads(payload)
                if isinstance(event, dict) and "error" in event:
                    raise RuntimeError(f"/generate: {event['error']}")
                yield event

    # ---- Backend ---------------------------------------------------------------------------------
    def generate(self, prompt: str, params: GenParams, *,
                 on_delta: Callable[[str], None] | None = None,
                 cancel: threading.Event | None = None) -> Generation:
        values = params.set_values()
        body: dict[str, Any] = {"text": prompt, "sampling_params": runtime_sampling_params(params)}
        for key in ("return_logprob", "logprob_start_len", "top_logprobs_num"):
            if values.get(key) is not None:
                body[key] = values[key]
        if params.return_text_in_logprobs:
            body["return_text_in_logprobs"] = True
        gen = GenTexts(params, on_delta)
        for event in self._events(body):  # closing the response aborts the request
            if cancel is not None and cancel.is_set():
                raise ProgramAborted("the program was interrupted")
            # text and meta_info are cumulative in SGLang's stream
            if gen.update(event.get("index", 0), event["text"], event["meta_info"]):
                break
        return gen.generation()

    def select(self, prompt: str, choices: tuple[str, ...], method: str) -> tuple[str, dict]:
        from lmnb.lang.choices import RuntimeChoiceScorer, select_choice

        result = select_choice(RuntimeChoiceScorer(_ScoringClient(self)), prompt, choices, method)
        return result.choice, result.meta_info

    def cache_prefix(self, prompt: str) -> None:
        if prompt:
            self._request("/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 0}})

    # ---- SGLang's backend calls ------------------------------------------------------------------
    def flush_cache(self) -> bool:
        try:
            self._open("/flush_cache", {}).close()
        except RuntimeError:  # HTTP 400: requests are running or waiting
            return False
        return True

    def get_server_info(self) -> dict[str, Any]:
        return self._request("/get_server_info")

    def get_model_name(self) -> str:
        return self.model_info["model_path"]


class _ScoringClient:
    """The part of `Runtime` that `RuntimeChoiceScorer` uses, over the endpoint."""

    def __init__(self, endpoint: RuntimeEndpoint) -> None:
        self.endpoint = endpoint
        self.tokenizer = endpoint.tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    def generate(self, *, input_ids: list[list[int]], sampling_params: dict[str, Any],
                 return_logprob: bool, logprob_start_len: int) -> list[dict[str, Any]]:
        results = self.endpoint._request("/generate", {
            "input_ids": input_ids, "sampling_params": sampling_params,
            "return_logprob": return_logprob, "logprob_start_len": logprob_start_len})
        results = results if isinstance(results, list) else [results]
        for result in results:  # SGLang's [logprob, id, text] triples -> (logprob, id)
            meta = result["meta_info"]
            meta["input_token_logprobs"] = [(lp, tid) for lp, tid, *_ in
                                            meta["input_token_logprobs"]]
        return results

    def cache_prefix(self, *, input_ids: list[int]) -> None:
        self.endpoint._request("/generate", {"input_ids": input_ids,
                                             "sampling_params": {"max_new_tokens": 0}})
