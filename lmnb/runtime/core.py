"""Shared vocabulary of the runtime: requests, batches, a pass's result, finish reasons (sampling
parameters live in `lmnb.params` and are re-exported here)."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lmnb.multimodal.items import MultimodalInputs

# Re-exported: `from lmnb.runtime.core import SamplingParams` keeps working.
from lmnb.params import InvalidRequestError as InvalidRequestError
from lmnb.params import SamplingParams as SamplingParams

# Finish reasons are made by the stop rules (`output/stop.py`); re-exported for the scheduler.
from lmnb.runtime.output.stop import finish_abort as finish_abort
from lmnb.runtime.output.stop import finish_length as finish_length
from lmnb.runtime.output.stop import finish_stop as finish_stop


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill of new tokens (possibly after a cached prefix, possibly a chunk)
    DECODE = "decode"  # one new token per request


class ReqStatus(enum.Enum):
    WAITING = "waiting"  # holds no KV; admitted by the prefill manager
    PREFILLING = "prefilling"  # part of its prompt prefilled (a chunk is pending)
    RUNNING = "running"  # decoding
    FINISHED = "finished"


_req_ids = itertools.count()


def next_rid() -> int:
    """A new request id (`Req.rid`'s default), for callers that announce ids before they
    build their requests."""
    return next(_req_ids)


@dataclass(eq=False, slots=True)
class Req:
    """One generation request as the scheduler sees it: plain data (ids, lengths, parameters,
    where its KV is, status), nothing that cannot cross a process boundary.

    KV: `req_to_token[req_pool_idx, :kv_len]` holds the slots of the tokens whose KV is computed;
    the first `prefix_len` belong to the prefix cache (locked through `cache_handle` while the
    request holds them), the rest to the request.
    """

    origin_input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    # SGLang's token_ids_logprob: ids whose logprobs are reported at every scored position.
    token_ids_logprob: list[int] | None = None
    rid: int = field(default_factory=next_rid)
    sample_index: int = 0  # which of the n samples of its prompt
    extra_key: Hashable = None  # prefix-cache namespace: equal tokens in other namespaces differ
    # Images / videos whose spans of pad ids (>= vocab_size) sit in `origin_input_ids`.
    mm_inputs: MultimodalInputs | None = None

    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    finished_reason: dict[str, Any] | None = None

    req_pool_idx: int | None = None
    kv_len: int = 0
    prefix_len: int = 0
    cache_handle: Any = None

    cached_tokens: int = 0  # prompt tokens served from the prefix cache (reported)
    input_logprobs_done: int = 0  # prompt logprobs computed so far (each is computed once)
    retractions: int = 0
    forward_passes: int = 0
    arrival_pass: int = 0  # scheduler forward-pass count when it arrived (for aging)
    admitted: bool = False  # admitted once already (retracted or jumped requests come back)
    jumps: int = 0  # jump-forward steps taken
    spec_verify_ct: int = 0  # speculative verify passes (SGLang's name)
    spec_draft_tokens: int = 0  # draft tokens proposed to them
    spec_accepted_tokens: int = 0  # of those accepted

    @property
    def fill_ids(self) -> Sequence[int]:
        """All tokens whose KV the request needs before its next decode step (read-only: the
        prompt list itself while there is no output, not a copy)."""
        if not self.output_ids:
            return self.origin_input_ids
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
    def text_prompt_ids(self) -> list[int]:
        """The prompt ids that text code (detokenizers, jump-forward's re-tokenization) may read:
        those after the last media span (pad ids are no text; a media token is a hard boundary)."""
        if self.mm_inputs is None or not self.mm_inputs.items:
            return self.origin_input_ids
        return self.origin_input_ids[max(item.end for item in self.mm_inputs.items):]

    @property
    def media_tokens(self) -> int:
        """Prompt tokens inside media spans."""
        return sum(item.num_tokens for item in self.mm_inputs.items) if self.mm_inputs else 0

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def owned_kv_len(self) -> int:
        return self.kv_len - self.prefix_len

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0

    @property
    def input_logprobs_needed_from(self) -> int:
        """First prompt position whose logprob is still missing."""
        return max(self.logprob_start_len, 0) + self.input_logprobs_done


@dataclass(slots=True)
class InputLogprobSpan:
    """Prompt logprobs one request of an EXTEND pass asks for: the tokens `targets` at positions
    `first_target ...`, each scored by the logits one position earlier; `token_ids`: ids whose
    logprobs it also wants at those positions."""

    first_target: int
    targets: list[int]
    top_logprobs_num: int
    token_ids: list[int] | None = None


@dataclass(slots=True)
class Batch:
    """One forward pass as plain data (picklable; what a model runner on any rank needs).

    Request i feeds `extend_lens[i]` new tokens at positions `prefix_lens[i] ...`, whose ids are
    the i-th run of `input_ids` and whose KV goes to the same run of `out_cache_loc`. DECODE is
    the case of one token per request. `samples[i]`: request i draws a token after the pass
    (false for a chunk that leaves part of the prompt to prefill). `follows_previous`: a DECODE
    pass of requests of the pass launched just before it, in the same order, whose sampled
    tokens (still on the device) are its input ids; `input_ids` is then empty. `previous_rows`:
    the row of that pass's sampled tokens each request continues (None: every row, so the same
    requests); -1 for a request whose input id is its entry of `input_ids` (then one per
    request: the decode pass right after a prefill pass also carries the running requests).
    """

    mode: ForwardMode
    rids: list[int]
    req_pool_indices: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    input_ids: list[int]
    out_cache_loc: torch.Tensor  # [sum(extend_lens)] int64 on the KV device
    samples: list[bool]
    input_logprobs: list[InputLogprobSpan | None] = field(default_factory=list)
    follows_previous: bool = False
    previous_rows: list[int] | None = None
    # EXTEND: per request (aligned with rids) its media, or None; empty for DECODE. The model
    # runner splices the embeddings of the items overlapping each request's extend range.
    mm_inputs: list[MultimodalInputs | None] = field(default_factory=list)
    # DECODE: (length, rows) of requests whose KV rows begin with the same cached slots; the
    # attention backend may read such a prefix once for its group (kernels/shared_prefix.py).
    shared_prefixes: list[tuple[int, list[int]]] = field(default_factory=list)
    # A speculative verify pass (an EXTEND over each running request's last token and its drafts,
    # `extend_lens[i] == 1 + len(drafts[i])`): per request its draft tokens; empty otherwise.
    drafts: list[list[int]] = field(default_factory=list)

    @property
    def is_verify(self) -> bool:
        return bool(self.drafts)

    @property
    def size(self) -> int:
        return len(self.rids)

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens, strict=True)]

    @property
    def has_media(self) -> bool:
        return any(mm is not None and mm.items for mm in self.mm_inputs)


TopLogprobs = list[tuple[float, int]]  # (logprob, token id), best first


@dataclass(slots=True)
class StepOutput:
    """What the model runner gives back for one `Batch`, per request in batch order.

    `next_token_ids[i]`: the token request i sampled, None when it did not sample (a chunk that
    leaves part of its prompt); its raw logprob in `next_token_logprobs[i]` (0.0 when no request
    of the batch asked for logprobs) and, when asked, its best alternatives in
    `next_top_logprobs[i]`. `input_logprobs[i]`: (logprob, token) of the prompt tokens this pass
    scored for request i (logprob None for a media pad id), empty unless it asked;
    `input_top_logprobs[i]` aligned with them (None entries without `top_logprobs_num`).
    `next_token_ids_logprobs[i]` / `input_token_ids_logprobs[i]`: likewise the (logprob, id) of
    each id of its `token_ids_logprob`, in its order (None when it has none).
    `failed[i]`: why request i could not sample (every token masked, NaN logits); its
    `next_token_ids[i]` is then None and it alone ends with that error.
    """

    next_token_ids: list[int | None]
    next_token_logprobs: list[float | None]
    next_top_logprobs: list[TopLogprobs | None]
    input_logprobs: list[list[tuple[float | None, int]]]
    input_top_logprobs: list[list[TopLogprobs | None]]
    next_token_ids_logprobs: list[TopLogprobs | None]
    input_token_ids_logprobs: list[list[TopLogprobs | None]]
    failed: dict[int, str] = field(default_factory=dict)

    @classmethod
    def empty(cls, size: int) -> StepOutput:
        """Nothing sampled, nothing scored, for a batch of `size` requests."""
        return cls([None] * size, [None] * size, [None] * size,
                   [[] for _ in range(size)], [[] for _ in range(size)],
                   [None] * size, [[] for _ in range(size)])


@dataclass(slots=True)
class VerifyOutput:
    """What the model runner gives back for a verify `Batch`, per request in batch order: the
    tokens it keeps (`tokens[i]`: its accepted drafts, then the token the target drew at the first
    rejected draft, or after the last one), their raw logprobs (0.0 when no request of the batch
    asked) and, when asked, their top logprobs and their `token_ids_logprob` logprobs;
    `failed[i]` as in `StepOutput` (its lists then empty)."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    top_logprobs: list[list[TopLogprobs | None]]
    token_ids_logprobs: list[list[TopLogprobs | None]]
    failed: dict[int, str] = field(default_factory=dict)

    def accepted(self, i: int) -> int:
        """Draft tokens request i accepted."""
        return len(self.tokens[i]) - 1
