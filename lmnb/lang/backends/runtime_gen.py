"""A `gen` against an lmnb (or SGLang) runtime, in process or over its native API: its samples'
text as the stream brings it (the parameters it sends are `GenParams.sampling_params()`, or
`sampling_values()` over HTTP). The runtime ends a request
on a `stop_regex` match; text streamed before the match completed is cut here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lmnb.lang.backends.base import Generation
from lmnb.lang.ir import GenParams
from lmnb.runtime.output.stop import compile_stop_regex, first_stop_regex_match


class GenTexts:
    """The text and meta_info of a gen's `n` samples as updates arrive; each sample is cut at its
    first `stop_regex` match, and (n == 1) each update's meta_info goes to `on_meta`, then its
    new text to `on_delta`."""

    def __init__(self, params: GenParams, on_delta: Callable[[str], None] | None,
                 on_meta: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.n = params.n or 1
        self.stop_regex = compile_stop_regex(params.stop_regex)
        self.on_delta = on_delta
        self.on_meta = on_meta
        self.texts = [""] * self.n
        self.metas: list[dict[str, Any]] = [{} for _ in range(self.n)]
        self._streamed = 0  # characters of texts[0] handed to on_delta
        self._ended: set[int] = set()  # samples whose last update came

    @property
    def complete(self) -> bool:
        """Every sample's last update (the runtime set its `finish_reason`) came."""
        return len(self._ended) == self.n

    def update(self, index: int, text: str, meta: dict[str, Any]) -> bool:
        """Sample `index` now reads `text` with `meta`; True when the gen is complete (its one
        sample hit a stop_regex: the caller closes the stream)."""
        if meta.get("finish_reason") is not None:  # the runtime's last update of the sample
            self._ended.add(index)
        match = first_stop_regex_match(self.stop_regex, text) if self.stop_regex else None
        if match:
            text = text[:match.start()]
            meta = {**meta, "finish_reason": {"type": "stop", "matched": match.group()}}
        self.texts[index], self.metas[index] = text, meta
        if self.n == 1 and self.on_meta is not None:
            self.on_meta(meta)
        if self.n == 1 and self.on_delta is not None and len(self.texts[0]) > self._streamed:
            self.on_delta(self.texts[0][self._streamed:])
            self._streamed = len(self.texts[0])
        return bool(match) and self.n == 1

    def generation(self) -> Generation:
        if self.n == 1:
            return Generation(self.texts[0], self.metas[0])
        return Generation(self.texts, self.metas)
