"""`/generate`'s streamed `meta_info`, as SGLang's: every event of a request carries its counts
(`weight_version`, `total_retractions`, `reasoning_tokens`, `cached_tokens`, beside the ids and
token counts) and, with `return_logprob`, its logprob lists so far (the prompt's whole, the
output's up to the event's last token, `output_token_logprobs_length`). The runtime's running
chunks carry the counts once, with the first token after each admission, and only their new
tokens' logprobs (`new_token_logprobs` ... from `output_ids_from`); its last chunk carries
everything."""

from __future__ import annotations

from typing import Any

from lmnb.runtime.output.logprob_lists import LISTS, PROMPT_LISTS, RUNNING_ONLY, OutputLists

Meta = dict[str, Any]

_COUNTS = ("cached_tokens", "total_retractions")


class StreamedMeta:
    """One request's meta_info so far; `add` each of its chunks' meta_info in order."""

    def __init__(self, weight_version: str) -> None:
        self._counts: Meta = {"weight_version": weight_version, "total_retractions": 0,
                              "reasoning_tokens": 0, "cached_tokens": 0}
        self._prompt: Meta = {}  # the prompt's lists, as the last admission gave them
        self._output = OutputLists()

    def add(self, meta: Meta) -> Meta:
        """The event's meta_info for a chunk whose meta_info is `meta`."""
        if meta.get("finish_reason") is not None:
            return meta  # the runtime's last meta_info is whole
        self._counts.update((key, meta[key]) for key in _COUNTS if key in meta)
        self._prompt.update((key, list(meta[key])) for key in PROMPT_LISTS if key in meta)
        self._output.add(meta)
        out = {key: value for key, value in meta.items() if key not in RUNNING_ONLY}
        out.update(self._counts)
        for prompt_key, (output_key, _) in LISTS.items():
            if prompt_key in self._prompt:
                out[prompt_key] = list(self._prompt[prompt_key])
            if self._output.has(output_key):
                out[output_key] = self._output.rows(output_key)
        if self._output.has("output_token_logprobs"):
            out["output_token_logprobs_length"] = len(out["output_token_logprobs"])
        return out
