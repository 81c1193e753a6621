"""Where each token of a request came from, for views that colour tokens by origin.

Asked for per request (`Runtime.generate(..., return_token_origins=True)`, which implies
`return_logprob`); requests that do not ask carry no `OutputOrigins` and pay nothing. The spans
go into `meta_info` as `(origin, start, end)` triples, `end` exclusive:

- `prompt_token_origins` over the prompt's positions: `cached` (served from the prefix cache
  when the request was first admitted: `meta_info["cached_tokens"]` of them) then `computed`;
- `output_token_origins` over the output's positions: `generated` (sampled), `jump_forward`
  (appended by a compressed-FSM jump, re-tokenized with the text before it: no logprob) and
  `speculated` (accepted from a speculative draft: `accept_speculated`).

While the request runs, each streamed chunk's `meta_info` carries the output spans so far and
`output_ids_from` (the output position where the chunk's `output_ids` go: a jump re-tokenizes
the tail, so it can be below the count streamed before), plus `new_token_logprobs` /
`new_top_logprobs` of the chunk's ids.
"""

from __future__ import annotations

from typing import Any

COMPUTED = "computed"
CACHED = "cached"
GENERATED = "generated"
JUMP_FORWARD = "jump_forward"
SPECULATED = "speculated"

PROMPT_ORIGINS = (CACHED, COMPUTED)
OUTPUT_ORIGINS = (GENERATED, JUMP_FORWARD, SPECULATED)
ORIGINS = (*PROMPT_ORIGINS, *OUTPUT_ORIGINS)

Span = tuple[str, int, int]  # (origin, start, end)


def prompt_spans(prompt_len: int, cached: int) -> list[Span]:
    """The prompt's spans: its first `cached` tokens from the cache, the rest computed."""
    cached = max(0, min(cached, prompt_len))
    spans: list[Span] = []
    if cached:
        spans.append((CACHED, 0, cached))
    if prompt_len > cached:
        spans.append((COMPUTED, cached, prompt_len))
    return spans


class OutputOrigins:
    """The origin of each output token of one request, as runs (a run per change of origin)."""

    __slots__ = ("_runs",)

    def __init__(self) -> None:
        self._runs: list[list[Any]] = []  # [origin, count], adjacent runs differ

    def __len__(self) -> int:
        return sum(count for _, count in self._runs)

    def add(self, origin: str, count: int = 1) -> None:
        """`count` tokens of `origin` appended to the output."""
        if count <= 0:
            return
        if self._runs and self._runs[-1][0] == origin:
            self._runs[-1][1] += count
        else:
            self._runs.append([origin, count])

    def truncate(self, length: int) -> None:
        """The output was cut to its first `length` tokens (a jump re-tokenized the rest)."""
        left = length
        for i, run in enumerate(self._runs):
            if run[1] >= left:
                run[1] = left
                del self._runs[i + (1 if left else 0):]
                return
            left -= run[1]

    def spans(self) -> list[Span]:
        out: list[Span] = []
        at = 0
        for origin, count in self._runs:
            out.append((origin, at, at + count))
            at += count
        return out


def count_origin(spans: list[Span] | list[list[Any]], origin: str) -> int:
    """How many tokens of `spans` have `origin`."""
    return sum(end - start for name, start, end in spans if name == origin)


def accept_speculated(origins: OutputOrigins | None, count: int) -> None:
    """The hook of speculative decoding: `count` accepted draft tokens were appended to a
    request's output (the scheduler's verify pass calls it per accepted draft as it appends it;
    the target's own token after the chain is `generated`). A no-op for requests that did not
    ask for origins."""
    if origins is not None:
        origins.add(SPECULATED, count)
