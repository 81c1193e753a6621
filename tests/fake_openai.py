"""An in-process OpenAI-compatible endpoint over a scripted model, for `openai.OpenAI` clients.

`FakeEndpoint(document).client()` is an `openai.OpenAI` whose requests never leave the process
(`httpx.MockTransport`). The "model" writes `document`: it continues a text from the longest
prefix of the document that the text ends with (from the start when there is none), then ends
(EOS). One character is one token. Every request body and its billed usage is recorded.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai

_CHUNK = 4  # characters per streamed chunk


@dataclass
class Call:
    path: str
    body: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int


@dataclass
class FakeEndpoint:
    document: str
    logprobs: bool = True  # whether completions with echo return prompt logprobs
    echo: bool = True  # whether completions accept echo (else 400, as the lmnb server does)
    calls: list[Call] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def client(self) -> openai.OpenAI:
        http = httpx.Client(transport=httpx.MockTransport(self.handle))
        return openai.OpenAI(base_url="http://fake/v1", api_key="test", http_client=http,
                             max_retries=0)

    @property
    def billed_prompt_tokens(self) -> int:
        return sum(call.prompt_tokens for call in self.calls)

    # ---- the model -----------------------------------------------------------------------
    def continuation(self, text: str) -> str:
        for k in range(len(self.document), 0, -1):
            if text.endswith(self.document[:k]):
                return self.document[k:]
        return self.document

    def logprob(self, context: str, char: str) -> float:
        return -0.1 if self.continuation(context).startswith(char) else -5.0

    def complete(self, text: str, body: dict[str, Any]) -> tuple[str, str, str | None, int]:
        """(text, finish_reason, matched stop, completion tokens) of one sampled choice."""
        output = self.continuation(text)
        budget = body.get("max_tokens") or 16
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        hits = [(output.find(s), s) for s in stops if s and 0 <= output.find(s)]
        if hits:
            pos, stop = min(hits)
            if pos + len(stop) <= budget:
                return output[:pos], "stop", stop, pos + len(stop)
        if len(output) > budget:
            return output[:budget], "length", None, budget
        return output, "stop", None, len(output)

    # ---- HTTP ----------------------------------------------------------------------------
    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path.endswith("/chat/completions"):
            return self._chat(body)
        if request.url.path.endswith("/completions"):
            return self._completions(body)
        return httpx.Response(404, json={"error": {"message": "not found"}})

    def _record(self, path: str, body: dict[str, Any], prompt: int, completion: int) -> dict:
        with self._lock:
            self.calls.append(Call(path, body, prompt, completion))
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def _completions(self, body: dict[str, Any]) -> httpx.Response:
        if body.get("echo") and not self.echo:
            return httpx.Response(400, json={"error": {"message": "echo is not supported"}})
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        prompts = [p for p in prompts for _ in range(body.get("n") or 1)]  # n samples each
        choices, completion_tokens = [], 0
        for index, prompt in enumerate(prompts):
            text, reason, matched, tokens = self.complete(prompt, body)
            completion_tokens += tokens
            choice: dict[str, Any] = {"index": index, "text": text, "finish_reason": reason,
                                      "matched_stop": matched,
                                      "logprobs": _completion_logprobs(text, body)}
            if body.get("echo"):
                choice["text"] = prompt + text
                if body.get("logprobs") is not None and self.logprobs:
                    full = prompt + text
                    choice["logprobs"] = {
                        "tokens": list(full), "text_offset": list(range(len(full))),
                        "token_logprobs": [None] + [self.logprob(full[:i], full[i])
                                                    for i in range(1, len(full))],
                        "top_logprobs": None}
            choices.append(choice)
        usage = self._record("completions", body, sum(map(len, prompts)), completion_tokens)
        if body.get("stream"):
            (choice,) = choices
            return self._sse("text_completion", choice["text"], choice, usage, body,
                             lambda piece: {"text": piece,
                                            "logprobs": _completion_logprobs(piece, body)})
        return httpx.Response(200, json={"id": "cmpl", "object": "text_completion",
                                         "created": 0, "model": body["model"],
                                         "choices": choices, "usage": usage})

    def _chat(self, body: dict[str, Any]) -> httpx.Response:
        messages = body["messages"]
        prompt_tokens = sum(len(m["content"]) + 3 for m in messages)
        extra_continue = body.get("continue_final_message")
        partial = messages[-1]["content"] if messages[-1]["role"] == "assistant" else ""
        if partial and not extra_continue:
            return httpx.Response(400, json={"error": {"message": "last message is assistant"}})
        text, reason, matched, tokens = self.complete(partial, body)
        samples = body.get("n") or 1  # n samples, the same (the model is scripted)
        usage = self._record("chat", body, prompt_tokens, tokens * samples)
        choices = [{"index": index, "message": {"role": "assistant", "content": text},
                    "finish_reason": reason, "matched_stop": matched,
                    "logprobs": _chat_logprobs(text, body)} for index in range(samples)]
        if body.get("stream"):
            return self._sse("chat.completion.chunk", text, choices[0], usage, body,
                             lambda piece: {"delta": {"content": piece},
                                            "logprobs": _chat_logprobs(piece, body)})
        return httpx.Response(200, json={"id": "chat", "object": "chat.completion",
                                         "created": 0, "model": body["model"],
                                         "choices": choices, "usage": usage})

    @staticmethod
    def _sse(kind: str, text: str, choice: dict, usage: dict, body: dict, piece_of) -> Any:
        def event(choices: list[dict], with_usage: dict | None = None) -> bytes:
            payload = {"id": "s", "object": kind, "created": 0, "model": body["model"],
                       "choices": choices, "usage": with_usage}
            return f"data: {json.dumps(payload)}\n\n".encode()

        chunks = [event([{"index": 0, **piece_of(text[i:i + _CHUNK]), "finish_reason": None}])
                  for i in range(0, len(text), _CHUNK)]
        chunks.append(event([{"index": 0, **piece_of(""), "finish_reason":
                              choice["finish_reason"], "matched_stop": choice["matched_stop"]}]))
        if (body.get("stream_options") or {}).get("include_usage"):
            chunks.append(event([], usage))
        chunks.append(b"data: [DONE]\n\n")
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=b"".join(chunks))


def _completion_logprobs(text: str, body: dict[str, Any]) -> dict | None:
    if body.get("logprobs") is None or body.get("echo"):
        return None
    return {"tokens": list(text), "token_logprobs": [-0.1] * len(text),
            "text_offset": list(range(len(text))), "top_logprobs": None}


def _chat_logprobs(text: str, body: dict[str, Any]) -> dict | None:
    if not body.get("logprobs"):
        return None
    return {"content": [{"token": c, "logprob": -0.1, "bytes": None, "top_logprobs": []}
                        for c in text]}
