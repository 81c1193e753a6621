"""`/generate`'s streamed `meta_info`, as SGLang's: every event of a request carries its counts
(`weight_version`, `total_retractions`, `reasoning_tokens`, `cached_tokens`, beside the ids and
token counts) and, with `return_logprob`, its logprob lists so far (the prompt's whole, the
output's up to the event's last token, `output_token_logprobs_length`). The runtime's running
chunks carry the counts once, with the first token after each admission, and only their new
tokens' logprobs (`new_token_logprobs` ... from `output_ids_from`); its last chunk carries
everything."""

from __future__ import annotations

from typing import Any

from lmnb.runtime.output.logprob_lists import LISTS, RUNNING_ONLY

Meta = dict[str, Any]

_COUNTS = ("cached_tokens", "total_retractions")


class StreamedMeta:
    """One request's meta_info so far; `add` each of its chunks' meta_info in order."""

    def __init__(self, weight_version: str) -> None:
        self._counts: Meta = {"weight_version": weight_version, "total_retractions": 0,
                              "reasoning_tokens": 0, "cached_tokens": 0}
        self._lists: dict[str, list[Any]] = {}

    def add(self, meta: Meta) -> Meta:
        """The event's meta_info for a chunk whose meta_info is `meta`."""
        if meta.get("finish_reason") is not None:
            return meta  # the runtime's last meta_info is whole
        self._counts.update((key, meta[key]) for key in _COUNTS if key in meta)
        for prompt_key, (output_key, new_key) in LISTS.items():
            if prompt_key in meta:  # the request has these lists (they come at admission)
                self._lists[prompt_key] = list(meta[prompt_key])
                self._lists.setdefault(output_key, [])
            if new_key in meta and output_key in self._lists:
                self._lists[output_key][meta["output_ids_from"]:] = meta[new_key]
            elif output_key in meta:  # a stream whose events carry the lists whole so far
                self._lists[output_key] = list(meta[output_key])
        out = {key: value for key, value in meta.items() if key not in RUNNING_ONLY}
        out.update(self._counts)
        out.update((key, list(rows)) for key, rows in self._lists.items())
        if "output_token_logprobs" in self._lists:
            out["output_token_logprobs_length"] = len(self._lists["output_token_logprobs"])
        return out
