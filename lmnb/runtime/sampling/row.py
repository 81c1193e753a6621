"""The sampler's view of one request (the scheduler's `ReqState` is one)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from lmnb.runtime.core import SamplingParams
    from lmnb.runtime.fsm.protocol import Grammar


class SamplingRow(Protocol):
    """What the sampler reads of one request."""

    rid: int | None  # the request's id, in errors (None: a row that is no request's own)
    sampling_params: SamplingParams
    origin_input_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None
    grammar: Grammar | None
    return_logprob: bool
    top_logprobs_num: int
    token_ids_logprob: list[int] | None  # ids whose logprobs it wants (SGLang's)
