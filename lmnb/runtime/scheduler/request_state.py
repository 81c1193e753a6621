"""What the scheduler keeps beside each `Req`: its sampling state (grammar, seeded generator),
its stop checker and the logprobs it has accumulated. Not plain data; never leaves this process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from lmnb.runtime.core import Req, SamplingParams
from lmnb.runtime.output.token_origins import OutputOrigins

if TYPE_CHECKING:
    from lmnb.runtime.fsm.protocol import Grammar
    from lmnb.runtime.output.stop_text import StopText

Logprob = tuple[float | None, int]
TopLogprobs = list[tuple[float, int]]


@dataclass(slots=True)
class RequestLogprobs:
    input_token: list[Logprob] = field(default_factory=list)
    input_top: list[TopLogprobs | None] = field(default_factory=list)
    output_token: list[Logprob] = field(default_factory=list)
    output_top: list[TopLogprobs] = field(default_factory=list)
    # of the ids a request asked for (`token_ids_logprob`), like `input_top` / `output_top`
    input_token_ids: list[TopLogprobs | None] = field(default_factory=list)
    output_token_ids: list[TopLogprobs] = field(default_factory=list)


@dataclass(eq=False, slots=True)
class ReqState:
    """One live request: `req` plus its per-request state. Satisfies the sampler's SamplingRow
    protocol (rid, sampling_params, origin_input_ids, output_ids, generator, grammar,
    return_logprob, top_logprobs_num, token_ids_logprob)."""

    req: Req
    grammar: Grammar | None = None  # of a regex / JSON-schema / EBNF constrained request
    generator: torch.Generator | None = None
    stop_text: StopText | None = None  # watches stop strings / stop_regex, if the request has any
    logprobs: RequestLogprobs = field(default_factory=RequestLogprobs)
    created_at: float = 0.0
    jumped_tokens: int = 0  # ids appended by jump-forward steps (re-tokenized ones included)
    first_token_at: float = 0.0  # perf_counter() when its first output token was appended
    origins: OutputOrigins | None = None  # per output token, when asked (return_token_origins)

    @property
    def rid(self) -> int:
        return self.req.rid

    @property
    def sampling_params(self) -> SamplingParams:
        return self.req.sampling_params

    @property
    def origin_input_ids(self) -> list[int]:
        return self.req.origin_input_ids

    @property
    def output_ids(self) -> list[int]:
        return self.req.output_ids

    @property
    def return_logprob(self) -> bool:
        return self.req.return_logprob

    @property
    def top_logprobs_num(self) -> int:
        return self.req.top_logprobs_num

    @property
    def token_ids_logprob(self) -> list[int] | None:
        return self.req.token_ids_logprob
