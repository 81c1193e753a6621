"""`RuntimeEndpoint(url)`: runs programs on an lmnb or SGLang server through SGLang's native
routes (`/generate`, `/get_model_info`, `/get_server_info`, `/flush_cache`), as SGLang's backend
of the same name does.

    lmnb.set_default_backend(lmnb.RuntimeEndpoint("http://127.0.0.1:30000"))

The model's tokenizer (for role text and `select` scoring) is loaded from the `model_path` the
server reports, so the server must run on this machine or share its model folder.

Images and videos (a LLaVA server: `has_image_understanding`) are sent as base64 `data:` URLs in
`image_data` / `video_data`, as SGLang's `/generate` takes them; a video's frame count goes as
lmnb's `{"video": url, "num_frames": n}`."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from lmnb.lang.backends.base import (
    Generation,
    MediaInput,
    MediaUnsupported,
    ProgramAborted,
    media_data,
)
from lmnb.lang.backends.runtime_gen import GenTexts
from lmnb.lang.chat_template import ChatTemplate
from lmnb.lang.ir import GenParams
from lmnb.runtime.output.logprob_lists import asked_start


class RuntimeEndpoint:
    """Backend over a server's SGLang-native API (a `Backend`; `prepare_media` works when the
    server's model takes images or videos)."""

    is_chat_model = False  # programs send text; roles are rendered with the model's template
    reports_token_texts = False
    streams_meta_info = True  # `generate` takes `on_meta=`

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
    def media_token(self, kind: str) -> str | None:
        """The text of the model's image/video token (None: it takes no such media): lmnb
        servers name it in /get_model_info; an SGLang server's image token is `<image>`."""
        info = self.model_info
        token = info.get(f"{kind}_token")
        if token is None and kind == "image" and info.get("has_image_understanding"):
            token = "<image>"
        return token

    def prepare_media(self, kind: str, source: Any, *,
                      num_frames: int | None = None) -> MediaInput:
        token = self.media_token(kind)
        if token is None:
            raise MediaUnsupported(f"the server's model ({self.model_info.get('model_path')}) "
                                   f"takes no {kind}s")
        url = data_url(source, kind)
        data: Any = {"video": url, "num_frames": num_frames} if kind == "video" and num_frames \
            else url
        return MediaInput(kind, token, data)

    def media_token_ids(self) -> frozenset[int]:
        tokens = (self.media_token(kind) for kind in ("image", "video"))
        return frozenset(self.tokenizer.convert_tokens_to_ids(t) for t in tokens if t)

    def generate(self, prompt: str, params: GenParams, *,
                 on_delta: Callable[[str], None] | None = None,
                 on_meta: Callable[[dict[str, Any]], None] | None = None,
                 cancel: threading.Event | None = None,
                 media: Sequence[MediaInput] = ()) -> Generation:
        values = params.set_values()
        body: dict[str, Any] = {"text": prompt, "sampling_params": params.sampling_values(),
                                **media_data(media)}
        for key in ("return_logprob", "logprob_start_len", "top_logprobs_num"):
            if values.get(key) is not None:
                body[key] = values[key]
        if params.return_text_in_logprobs:
            body["return_text_in_logprobs"] = True
        gen = GenTexts(params, on_delta, on_meta)
        for event in self._events(body):  # closing the response aborts the request
            if cancel is not None and cancel.is_set():
                raise ProgramAborted("the program was interrupted")
            # text and meta_info are cumulative in SGLang's stream
            if gen.update(event.get("index", 0), event["text"], event["meta_info"]):
                break
        return gen.generation()

    def select(self, prompt: str, choices: tuple[str, ...], method: str, *,
               media: Sequence[MediaInput] = ()) -> tuple[str, dict]:
        from lmnb.lang.choices import RuntimeChoiceScorer, select_choice

        scorer = RuntimeChoiceScorer(_ScoringClient(self), media=media_data(media),
                                     media_token_ids=self.media_token_ids() if media else
                                     frozenset())
        result = select_choice(scorer, prompt, choices, method)
        return result.choice, result.meta_info

    def cache_prefix(self, prompt: str, *, media: Sequence[MediaInput] = ()) -> None:
        if prompt:
            self._request("/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 0},
                                        **media_data(media)})

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
                 return_logprob: bool = False, logprob_start_len: int | None = None,
                 **media: Any) -> list[dict[str, Any]]:
        """`Runtime.generate`'s prompt logprobs: from `logprob_start_len` on, each scored. A
        server gives none at the first position it returns (SGLang's scheduler scores the
        positions after it), so they are asked from one position earlier, that one left out."""
        body = {"input_ids": input_ids, "sampling_params": sampling_params,
                "return_logprob": return_logprob, **media}
        earlier = logprob_start_len is not None and logprob_start_len > 0
        if logprob_start_len is not None:
            body["logprob_start_len"] = asked_start(logprob_start_len)
        results = self.endpoint._request("/generate", body)
        results = results if isinstance(results, list) else [results]
        for result in results:  # SGLang's [logprob, id, text] triples -> (logprob, id)
            meta = result["meta_info"]
            if "input_token_logprobs" in meta:
                pairs = [(lp, tid) for lp, tid, *_ in meta["input_token_logprobs"]]
                meta["input_token_logprobs"] = pairs[1:] if earlier else pairs
        return results

    def cache_prefix(self, *, input_ids: list[int]) -> None:
        self.endpoint._request("/generate", {"input_ids": input_ids,
                                             "sampling_params": {"max_new_tokens": 0}})


_MIME = {"image": "image/png", "video": "video/mp4"}


def data_url(source: Any, kind: str) -> str:
    """A base64 `data:` URL of an image or video source: a file (read here), bytes, a data URL
    (kept), a PIL image or a uint8 array (PNG-encoded). URLs are refused: nothing is fetched."""
    import base64
    import io
    import os

    if isinstance(source, str) and source[:5].lower() == "data:":
        return source
    if isinstance(source, str) and source[:8].lower().startswith(("http://", "https://")):
        raise ValueError(f"{kind} URLs are not fetched (lmnb never uses the network): "
                         f"{source[:80]}; download it and pass the file")
    if isinstance(source, str | os.PathLike):
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise ValueError(f"{kind} file not found: {path}")
        with open(path, "rb") as file:
            data = file.read()
    elif isinstance(source, bytes | bytearray | memoryview):
        data = bytes(source)
    else:
        image = source
        if not hasattr(image, "save"):  # a numpy array
            from PIL import Image

            try:
                image = Image.fromarray(source)
            except Exception as error:
                raise ValueError(f"unsupported {kind} type {type(source).__name__}: "
                                 f"{error}") from None
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        data = buffer.getvalue()
    return f"data:{_MIME[kind]};base64,{base64.b64encode(data).decode()}"
