"""A request's logprob lists in `meta_info` and how its stream carries them.

The prompt's lists come whole, with the first chunk after each admission; the output's grow: a
running chunk carries only its own tokens' rows, under the `new_*` key of each output list, from
output position `output_ids_from` (`scheduler/stats.live_meta`); the last chunk carries every list
whole. `OutputLists` rebuilds the output's lists from a request's chunks. SGLang's `/generate`
stream instead repeats every list so far in each event (`server/streamed_meta.py`);
`running_form` turns such an event back into a running chunk."""

from __future__ import annotations

from typing import Any

# the prompt's list -> (the output's list, a running chunk's key of its new rows)
LISTS = {"input_token_logprobs": ("output_token_logprobs", "new_token_logprobs"),
         "input_top_logprobs": ("output_top_logprobs", "new_top_logprobs"),
         "input_token_ids_logprobs": ("output_token_ids_logprobs", "new_token_ids_logprobs")}
PROMPT_LISTS = tuple(LISTS)
RUNNING_ONLY = ("output_ids_from", *(new for _, new in LISTS.values()))


class OutputLists:
    """One request's output lists so far (`output_token_logprobs`, and those of the others its
    chunks bring), read from every one of its chunks in order: a running chunk's `new_*` rows
    go from `output_ids_from` on (a jump-forward re-tokenizes the tail: the rows past it are
    replaced); a chunk with a list whole (the last chunk, or an event of a stream that repeats
    the lists so far) replaces it."""

    def __init__(self) -> None:
        self._lists: dict[str, list[Any]] = {}

    def add(self, meta: dict[str, Any]) -> None:
        for output_key, new_key in LISTS.values():
            if output_key in meta:
                self._lists[output_key] = list(meta[output_key] or ())
            elif new_key in meta:
                rows = self._lists.setdefault(output_key, [])
                rows[meta.get("output_ids_from", len(rows)):] = meta[new_key]

    def has(self, output_key: str) -> bool:
        """Whether the chunks so far brought list `output_key`."""
        return output_key in self._lists

    def rows(self, output_key: str, start: int = 0) -> list[Any]:
        """List `output_key` so far from position `start` (a copy; empty if no chunk brought
        it)."""
        return self._lists.get(output_key, [])[start:]


def asked_start(start: int) -> int:
    """The `logprob_start_len` to ask a SGLang `/generate` for, to get a `Runtime`'s prompt
    logprobs from `start` on: such a server leaves the first position it returns unscored (a
    `Runtime` scores it past position 0), so a start past 0 is asked one position early and
    the caller drops that first entry of each prompt list."""
    return start - 1 if start > 0 else start


def running_form(meta: dict[str, Any], start: int, *, with_prompt: bool) -> dict[str, Any]:
    """A running event's meta_info whose lists are whole so far (SGLang's stream) as the
    runtime's running chunk: the output's rows from position `start` (the first the chunk's
    ids add or replace) as `new_*` from `output_ids_from`, the prompt's lists only
    `with_prompt`."""
    out = dict(meta)
    for prompt_key, (output_key, new_key) in LISTS.items():
        if output_key in out:
            out[new_key] = out.pop(output_key)[start:]
            out["output_ids_from"] = start
        if not with_prompt:
            out.pop(prompt_key, None)
    out.pop("output_token_logprobs_length", None)
    return out
