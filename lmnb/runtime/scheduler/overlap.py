"""The overlap schedule: the pass in flight and what may be launched behind it before its results
are processed (so the host's output work hides behind the device's).

- behind an EXTEND pass, or a DECODE pass when requests wait: the next EXTEND pass
  (`may_follow_extend`), whose admission needs nothing from the one in flight: a prefill
  pass's prompts went into the prefix cache when it was launched (`CacheManager.cache_pass`:
  its KV slots are written in stream order before any later pass reads them), so waiting
  requests sharing them are admitted on them; its requests that go on to decode (`going_on`)
  count in the KV reserve of the admission;
- behind a DECODE pass, when no EXTEND pass may follow it (nothing waits, or the KV pool has
  no room to admit what waits): the next decode pass of its requests (`decode_followers`):
  their input ids are the tokens still on the device; requests whose last token is in flight
  are left out;
- behind an EXTEND pass that no other may follow (nothing left to prefill, or no room to admit
  what waits): the first decode pass (`decode_after_prefill`) of the running requests (input
  ids known) and of the pass's requests (their first tokens, on the device).

A pass after one whose requests have grammar, penalties or drafts to consider waits for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from lmnb.runtime.core import Batch, ForwardMode, Req, StepOutput
from lmnb.runtime.output.stop import by_length
from lmnb.runtime.scheduler.request_table import RequestTable


class PendingStep(Protocol):
    def result(self) -> StepOutput:
        """Waits for a launched pass; returns what `StepRunner.run` would have."""


@dataclass(slots=True)
class InFlight:
    batch: Batch
    reqs: list[Req]
    pending: PendingStep

    @property
    def is_prefill(self) -> bool:
        """An EXTEND pass of prompts (not a speculative verify pass)."""
        return self.batch.mode is ForwardMode.EXTEND and not self.batch.is_verify

    @property
    def prefill_to_follow(self) -> bool:
        """A prefill pass another may be launched behind: none of its requests scores prompt
        tokens (those logits are computed when its results are read, which would then come
        after the next pass's forward: tensor-parallel ranks run collectives in launch order)."""
        return self.is_prefill and all(span is None for span in self.batch.input_logprobs)


def going_on(current: InFlight) -> list[Req]:
    """The requests of an EXTEND pass in flight that sample after it (they decode next)."""
    return [req for req, samples in zip(current.reqs, current.batch.samples, strict=True)
            if samples]


def may_follow_extend(current: InFlight, table: RequestTable) -> bool:
    """Whether an EXTEND pass may be planned and launched while `current` is in flight (a
    decode pass's requests are running: their reserve counts as is, one token early)."""
    followable = current.prefill_to_follow or current.batch.mode is ForwardMode.DECODE
    return followable and (bool(table.waiting) or table.chunked is not None)


def decode_after_prefill(current: InFlight, table: RequestTable, *, room: int
                         ) -> tuple[list[Req], list[int] | None] | None:
    """The decode pass behind a prefill pass in flight when nothing is left to prefill: the
    running requests, then the pass's requests that go on past the token it samples, and per
    request its row among the pass's sampled tokens (-1: a running request, whose input id is
    known; None: every sampled row, in order). None when a sampling state would need that
    token (penalties, min_new_tokens), a grammar must advance first, or KV room is short
    (retraction decides first). Requests may be waiting: the scheduler asks for this only
    when none of them could be admitted behind the pass in flight."""
    if not current.prefill_to_follow or table.chunked is not None:
        return None
    going: list[Req] = []
    rows: list[int] = []
    sampled = 0
    for req, samples in zip(current.reqs, current.batch.samples, strict=True):
        if not samples:
            continue
        live = table.state_of(req) is not None  # not aborted while its pass runs
        if live and by_length(req.sampling_params, len(req.output_ids) + 1) is None:
            going.append(req)
            rows.append(sampled)
        sampled += 1
    reqs = [*table.running, *going]
    if (not going or room < len(reqs) or not all(_state_free_sampling(req) for req in going)
            or any(table.states[req.rid].grammar is not None for req in reqs)):
        return None
    if not table.running and len(rows) == sampled:
        return reqs, None
    return reqs, [-1] * len(table.running) + rows


def decode_followers(current: InFlight, table: RequestTable, *, room: int
                     ) -> tuple[list[Req], list[int] | None] | None:
    """The requests of the DECODE pass in flight that the next decode pass carries, and their
    rows in it (None: all of them), if nothing stands in its way. Requests whose last token is
    in flight are left out (`previous_rows` picks the others' tokens on the device), so a
    request ending by length does not stall the pipeline; a subset rebuilds the sampling state
    from the requests' outputs, which lack the token in flight, so it is only taken when that
    state does not read them (penalties, min_new_tokens still blocking). Requests may be
    waiting: the scheduler asks for this only when no prefill pass of theirs could be admitted
    behind the pass in flight (the KV pool is full), so they wait one pass more at most."""
    reqs = current.reqs
    if (current.batch.mode is not ForwardMode.DECODE or table.chunked is not None
            or table.running != reqs or room < len(reqs)):
        return None
    keep: list[int] = []
    for i, req in enumerate(reqs):
        if table.states[req.rid].grammar is not None:
            return None
        if by_length(req.sampling_params, len(req.output_ids) + 1) is None:
            keep.append(i)  # goes on past the token in flight
    if not keep:
        return None
    if len(keep) == len(reqs):
        return list(reqs), None
    going = [reqs[i] for i in keep]
    if not all(_state_free_sampling(req) for req in going):
        return None
    return going, keep


def _state_free_sampling(req: Req) -> bool:
    """Whether a sampling state rebuilt from the request's output ids, which lack the token in
    flight, is still right: no penalties, and min_new_tokens reached even without that token."""
    params = req.sampling_params
    return not params.has_penalties and params.min_new_tokens <= len(req.output_ids)
