"""Sampling as batch tensors: `SamplingBatchInfo` (built when the batch changes), `Sampler`
(one step, no host sync), `SampleOutput` (one wait per step), packed grammar bitmasks."""

from lmnb.runtime.sampling.batch_info import SamplingBatchInfo
from lmnb.runtime.sampling.bitmask import (
    all_allowed,
    apply_bitmask_,
    num_words,
    pack_mask,
    stack_bitmasks,
    unpack_bitmask,
)
from lmnb.runtime.sampling.output import SampleOutput
from lmnb.runtime.sampling.row import SamplingRow
from lmnb.runtime.sampling.sampler import Sampler

__all__ = [
    "SampleOutput", "Sampler", "SamplingBatchInfo", "SamplingRow", "all_allowed",
    "apply_bitmask_", "num_words", "pack_mask", "stack_bitmasks", "unpack_bitmask",
]
