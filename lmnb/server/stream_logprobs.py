"""The output logprobs of streamed choices a chunk at a time: OpenAI's chunks carry those of
their own new tokens (as vLLM's and SGLang's do), not all of them in a choice's last chunk."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

Meta = dict[str, Any]

# What a stream is asked for so that its running chunks carry their tokens' logprobs
# (`new_token_logprobs` / `new_top_logprobs` from output position `output_ids_from`).
RUNNING_LOGPROBS: Mapping[str, Any] = MappingProxyType({"return_token_origins": True})


class StreamedLogprobs:
    """Per choice, the `(logprob, token_id)` pairs and top rows received so far, and how many
    were given out. A running chunk's lists go from `output_ids_from` on; a last chunk has the
    whole `output_token_logprobs` / `output_top_logprobs`. A jump-forward re-tokenizes the
    output's tail: positions given out already are not given again."""

    def __init__(self) -> None:
        self._pairs: dict[int, list[Any]] = {}
        self._tops: dict[int, list[Any]] = {}
        self._sent: dict[int, int] = {}

    def add(self, index: int, meta: Meta) -> None:
        """Reads a chunk of choice `index` (every one, in order)."""
        pairs = self._pairs.setdefault(index, [])
        tops = self._tops.setdefault(index, [])
        if "output_token_logprobs" in meta:
            pairs[:] = meta["output_token_logprobs"]
            tops[:] = meta.get("output_top_logprobs") or []
        elif "new_token_logprobs" in meta:
            start = meta.get("output_ids_from", len(pairs))
            pairs[start:] = meta["new_token_logprobs"]
            tops[start:] = meta.get("new_top_logprobs") or []

    def take(self, index: int) -> Meta | None:
        """meta_info-shaped lists of choice `index`'s tokens not given out yet, or None."""
        pairs, tops = self._pairs.get(index, []), self._tops.get(index, [])
        sent = self._sent.get(index, 0)
        if len(pairs) <= sent:
            return None
        self._sent[index] = len(pairs)
        return {"output_token_logprobs": pairs[sent:], "output_top_logprobs": tops[sent:]}
