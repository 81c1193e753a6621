"""Shared vocabulary of the runtime: requests, batches, finish reasons (sampling parameters live
in `lmnb.params` and are re-exported here)."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

# Re-exported: `from lmnb.runtime.core import SamplingParams` keeps working.
from lmnb.params import InvalidRequestError as InvalidRequestError
from lmnb.params import SamplingParams as SamplingParams


def finish_length(length: int) -> dict[str, Any]:
    return {"type": "length", "length": length}


def finish_stop(matched: int | str) -> dict[str, Any]:
    return {"type": "stop", "matched": matched}


def finish_abort(message: str) -> dict[str, Any]:
    return {"type": "abort", "message": message}


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill of new tokens (possibly after a cached prefix, possibly a chunk)
    DECODE = "decode"  # one new token per request


_req_ids = itertools.count()


@dataclass(eq=False)
class Req:
    """One generation request as the scheduler sees it.

    KV ownership: `req_to_token[req_pool_idx, :kv_len]` holds the slots of the tokens whose KV is
    computed. The first `len(prefix_indices)` belong to the prefix cache (locked through
    `last_node` while the request lives); the rest belong to the request.
    """

    origin_input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    rid: int = field(default_factory=lambda: next(_req_ids))
    sample_index: int = 0  # which of the n samples of its prompt
    extra_key: Hashable = None  # prefix-cache namespace: equal tokens in other namespaces differ

    output_ids: list[int] = field(default_factory=list)
    finished_reason: dict[str, Any] | None = None

    # KV state, owned by the scheduler thread.
    req_pool_idx: int | None = None
    prefix_indices: torch.Tensor | None = None
    last_node: Any = None
    kv_len: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (reported)
    retractions: int = 0
    forward_passes: int = 0
    created_at: float = 0.0
    arrival_pass: int = 0  # scheduler forward-pass count when it arrived (for aging)
    admitted: bool = False  # admitted once already (retracted or jumped requests come back)
    grammar: Any = None  # RequestGrammar of a regex / JSON-schema constrained request
    jumps: int = 0  # jump-forward steps taken

    # Logprobs accumulated so far.
    input_token_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)

    generator: torch.Generator | None = None
    detokenizer: Any = None
    sink: Any = None  # where outputs go (engine side); called from the scheduler thread

    @property
    def fill_ids(self) -> list[int]:
        """All tokens whose KV the request needs before its next decode step."""
        return self.origin_input_ids + self.output_ids

    @property
    def fill_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def fill_slice(self, start: int, end: int) -> list[int]:
        """`fill_ids[start:end]` without building the whole list (the decode hot path)."""
        prompt_len = len(self.origin_input_ids)
        if start >= prompt_len:
            return self.output_ids[start - prompt_len:end - prompt_len]
        if end <= prompt_len:
            return self.origin_input_ids[start:end]
        return self.origin_input_ids[start:] + self.output_ids[:end - prompt_len]

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def owned_kv_len(self) -> int:
        prefix = 0 if self.prefix_indices is None else len(self.prefix_indices)
        return self.kv_len - prefix

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0

    @property
    def input_logprobs_needed_from(self) -> int:
        """First prompt position whose logprob is still missing (each is computed once)."""
        return max(self.logprob_start_len, 0) + len(self.input_token_logprobs)


@dataclass
class Batch:
    """One forward pass: each request feeds `fill_ids[kv_len : kv_len + extend_lens[i]]`.

    DECODE is the case of one token per request. `samples[i]` says whether request i draws its
    next token after this pass (false for a chunk that leaves part of the prompt to prefill).
    """

    mode: ForwardMode
    reqs: list[Req]
    prefix_lens: list[int]
    extend_lens: list[int]
    out_cache_loc: torch.Tensor
    samples: list[bool]
