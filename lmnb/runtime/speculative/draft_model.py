"""STANDALONE drafts (SGLang's `speculative_algorithm="STANDALONE"`): a smaller model with the
target's tokenizer proposes each chain greedily, one draft model pass per token.

The draft model has its own `ModelRunner` (KV pool, request rows, attention backend, decode CUDA
graphs on a GPU) and its own slot allocator; it has no prefix cache: a request's tokens are
prefilled on the draft model when it first drafts. Per request it keeps the KV of a prefix of the
request's tokens (`kv_len`); a step catches up on the tokens since (one pass over the batch,
whose last position gives the first draft: as decode rows, `rows.py`, so a decode CUDA graph
replays it where its rows fit one, else one EXTEND) and decodes the rest of the chain (decode
graphs); after the verify pass only the KV of accepted tokens stays. Greedy drafts are point
masses, so the verify step's rejection sampling keeps the target's distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lmnb.runtime.core import Batch, ForwardMode, Req, SamplingParams
from lmnb.runtime.memory import KVAllocator
from lmnb.runtime.model_runner import ModelRunner
from lmnb.runtime.speculative.rows import last_rows
from lmnb.runtime.speculative.speculator import DraftAsk

_GREEDY = SamplingParams(temperature=0.0)


@dataclass(slots=True)
class _GreedyRow:
    """The draft model's sampling row of one request (a `SamplingRow`)."""

    sampling_params: SamplingParams = field(default_factory=lambda: _GREEDY)
    origin_input_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    grammar: None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    rid: int | None = None


@dataclass(slots=True)
class _Track:
    row: int  # the request's row in the draft model's req_to_token pool
    output_ref: list[int]  # the request's output list (jump-forward replaces it: start afresh)
    tokens: list[int] = field(default_factory=list)  # the tokens whose draft KV the row holds
    checked: int = 0  # tokens[:checked] are known to be the request's


class DraftModelSource:
    """A `DraftSource` over a draft `ModelRunner` (see the module docstring)."""

    def __init__(self, runner: ModelRunner, allocator: KVAllocator) -> None:
        self.runner = runner
        self.allocator = allocator
        self.table = runner.req_to_token_pool.req_to_token
        self._tracks: dict[int, _Track] = {}
        self.passes = 0
        self.row_passes = 0  # catch-up passes run as decode rows

    def draft(self, asks: Sequence[DraftAsk]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in asks]
        live: list[int] = []
        tracks: list[_Track] = []
        fills: list[list[int]] = []
        room = self.allocator.available()
        for i, ask in enumerate(asks):
            req = ask.state.req
            if req.media_tokens or req.fill_len + ask.k > self.runner.context_len:
                continue
            track = self._tracks.get(req.rid)
            if track is None and self.runner.req_to_token_pool.available() == 0:
                continue
            fill = req.fill_ids
            track = self._reconciled(req, fill)
            need = len(fill) - len(track.tokens) + ask.k - 1
            if need > room:
                continue
            room -= need
            live.append(i)
            tracks.append(track)
            fills.append(fill)
        if not live:
            return drafts
        first = self._pass(ForwardMode.EXTEND, tracks,
                           [fill[len(t.tokens):] for fill, t in zip(fills, tracks, strict=True)])
        for i, token in zip(live, first, strict=True):
            drafts[i].append(token)
        going = [(i, t) for i, t in zip(live, tracks, strict=True) if asks[i].k > 1]
        while going:
            tokens = self._pass(ForwardMode.DECODE, [t for _, t in going],
                                [[drafts[i][-1]] for i, _ in going])
            for (i, _), token in zip(going, tokens, strict=True):
                drafts[i].append(token)
            going = [(i, t) for i, t in going if len(drafts[i]) < asks[i].k]
        return drafts

    def _reconciled(self, req: Req, fill: list[int]) -> _Track:
        """The request's track, its KV cut back to the longest prefix of its tokens that is
        still the request's (drafts that were rejected, or never verified, go)."""
        track = self._tracks.get(req.rid)
        if track is None:
            track = self._tracks[req.rid] = _Track(self.runner.req_to_token_pool.alloc(),
                                                   req.output_ids)
        if track.output_ref is not req.output_ids:  # jump-forward re-tokenized the output
            track.output_ref, track.checked = req.output_ids, 0
            self._drop(track, 0)
        same = track.checked
        limit = min(len(track.tokens), len(fill) - 1)  # the last token is always fed again
        while same < limit and track.tokens[same] == fill[same]:
            same += 1
        self._drop(track, same)
        track.checked = same
        return track

    def _pass(self, mode: ForwardMode, tracks: list[_Track], inputs: list[list[int]]
              ) -> list[int]:
        """One draft model pass: request i feeds `inputs[i]` after its tokens; the greedy next
        token of each."""
        lens = [len(ids) for ids in inputs]
        slots = self.allocator.alloc(sum(lens))
        start = 0
        prefix_lens = []
        for track, ids, n in zip(tracks, inputs, lens, strict=True):
            kv_len = len(track.tokens)
            prefix_lens.append(kv_len)
            self.table[track.row, kv_len:kv_len + n] = slots[start:start + n]
            track.tokens.extend(ids)
            start += n
        size = len(tracks)
        batch = Batch(mode=mode, rids=list(range(size)),
                      req_pool_indices=[t.row for t in tracks], prefix_lens=prefix_lens,
                      extend_lens=lens, input_ids=[t for ids in inputs for t in ids],
                      out_cache_loc=slots, samples=[True] * size,
                      input_logprobs=[None] * size,
                      mm_inputs=[] if mode is ForwardMode.DECODE else [None] * size)
        self.passes += 1
        if mode is ForwardMode.DECODE or self.runner.rows_replay(batch):
            # decode rows (a decode graph replays them where they fit one): the argmax of each
            # request's last row, without the sampler's per-pass state
            if mode is ForwardMode.EXTEND:
                self.row_passes += 1
            logits = self.runner.position_logits(
                batch, None if mode is ForwardMode.DECODE else last_rows(lens), as_rows=True)
            return logits[:, :self.runner.vocab_size].argmax(dim=-1).tolist()
        out = self.runner.run(batch, [_GreedyRow() for _ in tracks])
        return [int(token) for token in out.next_token_ids]

    def _drop(self, track: _Track, kv_len: int) -> None:
        """Frees the track's draft KV past its first `kv_len` tokens."""
        if kv_len < len(track.tokens):
            self.allocator.free(self.table[track.row, kv_len:len(track.tokens)].clone())
            del track.tokens[kv_len:]

    def verified(self, req: Req, *, accepted: int) -> None:
        """The rejected drafts' KV goes at the request's next draft (`_reconciled`)."""

    def finished(self, req: Req, *, keep: bool) -> None:
        track = self._tracks.pop(req.rid, None)
        if track is not None:
            self._drop(track, 0)
            self.runner.req_to_token_pool.free(track.row)

    def reset(self) -> None:
        pass

    def close(self) -> None:
        self._tracks.clear()
        self.runner.close()

    def check(self) -> None:
        """Raises AssertionError unless every draft KV slot and row is accounted for."""
        held = sum(len(t.tokens) for t in self._tracks.values())
        if self.allocator.available() + held != self.allocator.size:
            raise AssertionError(f"draft KV slots leaked: {self.allocator.available()} free + "
                                 f"{held} held != {self.allocator.size}")
        pool = self.runner.req_to_token_pool
        if pool.size - pool.available() != len(self._tracks):
            raise AssertionError("draft request rows leaked")

    def report(self) -> dict[str, Any]:
        return {"draft_passes": self.passes, "draft_row_passes": self.row_passes,
                "draft_kv_tokens": self.allocator.size - self.allocator.available()}
