"""`Speculator`: the scheduler's speculative-decoding partner. Per decode step it decides how many
draft tokens each running request may take, asks its `DraftSource` for them (an n-gram index:
`NgramSource`; a draft model: `draft_model.DraftModelSource`), cuts them where the request's
grammar refuses, learns from each verify pass and reports.

A request drafts only when its sampling state along the chain is the one at its first position
(no penalties, `min_new_tokens` reached), when its grammar (if any) can be forked, and when its
`RequestGate` is open; a batch larger than `max_batch_size` does not speculate at all.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lmnb.runtime.core import Batch, ForwardMode, Req
from lmnb.runtime.fsm.protocol import Grammar
from lmnb.runtime.scheduler.request_state import ReqState
from lmnb.runtime.speculative.config import NGRAM_MIN_MATCH, SpeculativeConfig
from lmnb.runtime.speculative.cost import PassCost
from lmnb.runtime.speculative.gate import RequestGate, best_draft_length
from lmnb.runtime.speculative.ngram import NgramCorpus, TokenSequence


@dataclass(slots=True)
class DraftAsk:
    """A request that may take up to `k` draft tokens this step."""

    state: ReqState
    k: int


class DraftSource(Protocol):
    """Where draft tokens come from."""

    def draft(self, asks: Sequence[DraftAsk]) -> list[list[int]]:
        """Per ask (in order) at most `ask.k` tokens continuing its request's tokens (prompt and
        output); an empty list when it has none."""

    def verified(self, req: Req, *, accepted: int) -> None:
        """`req`'s last drafts were verified, `accepted` of them kept (before the kept tokens
        are appended)."""

    def finished(self, req: Req, *, keep: bool) -> None:
        """`req` ended (`keep`: its tokens may serve other requests)."""

    def reset(self) -> None:
        """Forgets what other requests taught it (`flush_cache`)."""

    def check(self) -> None:
        """Raises AssertionError unless its own KV (a draft model's) is accounted for."""

    def close(self) -> None:
        """Frees what it holds (a draft model and its KV)."""

    def report(self) -> dict[str, Any]:
        ...


class Speculator:
    def __init__(self, config: SpeculativeConfig, source: DraftSource,
                 eos_token_ids: Iterable[int]) -> None:
        self.config = config
        self.source = source
        self.eos_token_ids = frozenset(eos_token_ids)
        self.cost = PassCost()
        self._gates: dict[int, RequestGate] = {}
        self._draft_seconds = 0.0  # the last proposal's drafting time (a draft model's passes)
        self.verify_passes = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.pauses = 0
        self.large_batch_steps = 0  # decode steps that did not speculate: batch too large
        self.seconds = {"draft": 0.0, "verify": 0.0, "decode": 0.0}  # synchronous passes
        self.passes = {"draft": 0, "verify": 0, "decode": 0}  # (draft: proposals drafted)
        self.state = "idle"

    # ---- proposing ----------------------------------------------------------------------------
    def propose(self, states: Sequence[ReqState], room: int) -> list[list[int]] | None:
        """Per request (in order) its draft tokens, at most `room` in all; None when no request
        has any (the step is a plain decode)."""
        if len(states) > self.config.max_batch_size:
            self.large_batch_steps += 1
            self.state = (f"off: batch of {len(states)} > speculative_max_batch_size "
                          f"{self.config.max_batch_size}")
            return None
        asks: list[DraftAsk] = []
        where: list[int] = []
        for i, state in enumerate(states):
            k = self._budget(state, room)
            if k > 0:
                room -= k
                asks.append(DraftAsk(state, k))
                where.append(i)
        drafts: list[list[int]] = [[] for _ in states]
        if asks:
            start = time.perf_counter()
            found = self.source.draft(asks)
            self._draft_seconds = time.perf_counter() - start
            self.seconds["draft"] += self._draft_seconds
            self.passes["draft"] += 1
            for i, ask, tokens in zip(where, asks, found, strict=True):
                drafts[i] = self._allowed(ask.state, tokens[:ask.k])
                if not drafts[i]:
                    self._gate(ask.state.req).missed(len(ask.state.req.output_ids))
        if not any(drafts):
            self.state = "on: no drafts this step"
            return None
        self.state = "on: verifying"
        return drafts

    def may_draft(self, states: Iterable[ReqState]) -> bool:
        """Whether some request might draft at its next step (the overlap schedule must then
        stop: drafts need the token in flight). `states` after their token in flight."""
        states = list(states)
        if len(states) > self.config.max_batch_size:
            return False
        return any(self._eligible(state) and self._gate(state.req).open(
            len(state.req.output_ids) + 1) for state in states)

    def _eligible(self, state: ReqState) -> bool:
        """Its sampling state is the same at every chain position; a seeded sampled request
        never drafts: a verify row draws from its generator, so its text would follow its drafts,
        which follow the timings (adaptive), the corpus of earlier requests (NGRAM) and the rest
        of the batch (the batch-size cap): the same seed must give the same text."""
        params = state.sampling_params
        if params.has_penalties or params.min_new_tokens > len(state.req.output_ids):
            return False
        return params.seed is None or params.is_greedy

    def _budget(self, state: ReqState, room: int) -> int:
        """Draft tokens this request may take now (0: none)."""
        req = state.req
        k = min(self.config.max_draft_tokens, room,
                req.sampling_params.max_new_tokens - len(req.output_ids) - 1)
        if k <= 0 or not self._eligible(state):
            return 0
        if state.grammar is not None and state.grammar.fork() is None:
            return 0
        output_len = len(req.output_ids)
        gate = self._gate(req)
        if not gate.open(output_len):
            return 0
        if self.config.draft_policy == "adaptive" and not gate.probe:
            fixed, per_draft = self.cost.model()
            k = best_draft_length(gate.alpha, fixed=fixed, per_draft=per_draft, longest=k)
            if k == 0:  # drafts would not pay at this acceptance: a pause, then a fresh start
                gate.pause_now(output_len)
                self.pauses += 1
        return k

    def _allowed(self, state: ReqState, drafts: list[int]) -> list[int]:
        if state.grammar is None or not drafts:
            return drafts
        fork = state.grammar.fork()
        if fork is None:
            return []
        stops = self.eos_token_ids.union(state.sampling_params.stop_token_ids)
        return passing_prefix(fork, drafts, stops)

    def _gate(self, req: Req) -> RequestGate:
        gate = self._gates.get(req.rid)
        if gate is None:
            gate = self._gates[req.rid] = RequestGate()
        return gate

    # ---- learning -----------------------------------------------------------------------------
    def timed(self, batch: Batch, seconds: float) -> None:
        """A synchronous decode or verify pass took `seconds` (the cost model's input; a verify
        pass is charged its drafting time too)."""
        if batch.is_verify:
            self.seconds["verify"] += seconds
            self.passes["verify"] += 1
            self.cost.verified(seconds + self._draft_seconds,
                               sum(batch.extend_lens) - batch.size)
        elif batch.mode is ForwardMode.DECODE:
            self.seconds["decode"] += seconds
            self.passes["decode"] += 1
            self.cost.decoded(seconds)

    def verified(self, req: Req, *, drafted: int, accepted: int) -> None:
        """After a verify pass, before its tokens are appended to `req.output_ids`."""
        if not drafted:
            return
        self.source.verified(req, accepted=accepted)
        self.verify_passes += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        req.spec_verify_ct += 1
        req.spec_draft_tokens += drafted
        req.spec_accepted_tokens += accepted
        if self._gate(req).verified(drafted=drafted, accepted=accepted,
                                    output_len=len(req.output_ids) + accepted + 1,
                                    min_rate=self.config.min_accept_rate):
            self.pauses += 1

    def finished(self, req: Req, *, keep: bool) -> None:
        self._gates.pop(req.rid, None)
        self.source.finished(req, keep=keep)

    def reset(self) -> None:
        self.source.reset()

    def check(self) -> None:
        self.source.check()

    def close(self) -> None:
        self.source.close()

    # ---- reporting ----------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """`stats()["speculative"]`."""
        passes = self.verify_passes
        fixed, per_draft = self.cost.model()
        return {
            "algorithm": self.config.algorithm,
            "num_draft_tokens": self.config.num_draft_tokens,
            "state": self.state,
            "verify_passes": passes,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "accept_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
            # tokens a verify pass yields: the accepted drafts and the target's own token
            "mean_accept_length": (self.accepted_tokens + passes) / passes if passes else 0.0,
            "pauses": self.pauses,
            "large_batch_steps": self.large_batch_steps,
            "verify_cost_model": {"fixed": fixed, "per_draft": per_draft},
            "seconds": dict(self.seconds), "timed_passes": dict(self.passes),
            **self.source.report(),
        }


@dataclass(slots=True)
class _Track:
    """One live request's n-gram index."""

    sequence: TokenSequence
    output_ref: list[int]  # the request's output list when indexed (jump-forward replaces it)
    indexed_output: int


class NgramSource:
    """NGRAM drafts: the request's own prompt and output first, then recent requests."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.corpus = NgramCorpus(config.ngram_capacity)
        self._tracks: dict[int, _Track] = {}

    def draft(self, asks: Sequence[DraftAsk]) -> list[list[int]]:
        return [self._find(self._track(ask.state.req).sequence, ask.k) for ask in asks]

    def _find(self, sequence: TokenSequence, k: int) -> list[int]:
        config = self.config
        options = dict(k=k, max_depth=config.ngram_max_trie_depth, min_depth=NGRAM_MIN_MATCH,
                       prefer_frequent=config.ngram_match_type == "PROB")
        own = sequence.find(sequence.tokens, periodic=True, **options)
        if own is not None and own.depth >= config.ngram_max_trie_depth:
            return own.tokens
        other = self.corpus.find(sequence.tokens[-config.ngram_max_trie_depth:], **options)
        if other is not None and (own is None or other.depth > own.depth):
            return other.tokens
        return own.tokens if own is not None else []

    def _track(self, req: Req) -> _Track:
        """The request's index, brought up to date with its output."""
        track = self._tracks.get(req.rid)
        if track is None or track.output_ref is not req.output_ids:
            track = _Track(TokenSequence(req.text_prompt_ids), req.output_ids, 0)
            self._tracks[req.rid] = track
        if track.indexed_output < len(req.output_ids):
            track.sequence.extend(req.output_ids[track.indexed_output:])
            track.indexed_output = len(req.output_ids)
        return track

    def verified(self, req: Req, *, accepted: int) -> None:
        pass

    def finished(self, req: Req, *, keep: bool) -> None:
        self._tracks.pop(req.rid, None)
        if keep:  # indexed when a proposal first searches it
            self.corpus.add([*req.text_prompt_ids, *req.output_ids])

    def reset(self) -> None:
        self.corpus.clear()

    def check(self) -> None:
        pass

    def close(self) -> None:
        self._tracks.clear()
        self.corpus.clear()

    def report(self) -> dict[str, Any]:
        return {"corpus_tokens": self.corpus.tokens,
                "corpus_indexed_sequences": self.corpus.indexed}


def passing_prefix(grammar: Grammar, drafts: Sequence[int], stop_ids: frozenset[int]
                   ) -> list[int]:
    """The longest prefix of `drafts` the constraint allows (walking `grammar`, a fork), cut
    after a stop id or where the constraint completes or dies (the request would end there)."""
    kept: list[int] = []
    for token in drafts:
        if not _allows(grammar.bitmask(stop_ids, "cpu"), token):
            break
        kept.append(token)
        if token in stop_ids:
            break
        grammar.advance(token)
        if grammar.is_final or grammar.is_dead:
            break
    return kept


def _allows(bitmask: torch.Tensor, token: int) -> bool:
    word, bit = divmod(token, 32)
    return 0 <= word < bitmask.numel() and bool((int(bitmask[word]) >> bit) & 1)
