"""`EncodedSubmitter`: a runtime that takes one prompt already tokenized by its own tokenizer,
with parsed `SamplingParams` (`Runtime.submit_encoded`). The DSL's local backend submits there,
skipping the public `generate`'s parsing of parameters and re-checking of ids; a runtime without
it (`DataParallelRuntime`, test stand-ins) gets `generate`. Importing this needs no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from lmnb.params import SamplingParams
    from lmnb.runtime.output import OutputStream


@runtime_checkable
class EncodedSubmitter(Protocol):
    def submit_encoded(self, ids: list[int], params: SamplingParams, *,
                       return_logprob: bool = False, logprob_start_len: int | None = None,
                       top_logprobs_num: int | None = None, return_token_origins: bool = False,
                       incremental: bool = True) -> OutputStream:
        """`generate(input_ids=ids, sampling_params=params, stream=True)` of one prompt."""
        ...
