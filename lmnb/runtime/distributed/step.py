"""What rank 0 sends the other ranks: commands, and for each forward pass the plain data of its
`Batch` with the KV slots it reads, so that every rank runs the same pass on its own shard.

    control broadcast (gloo, CPU int64, fixed length 8 + 6 * max_bs, one per command; only the
    first 8 + 6 * bs are meaningful)
        [cmd, mode, bs, num_tokens, num_kv_tokens, arg, 0, 0]
        + req_pool_indices | prefix_lens | extend_lens | samples | span_row | span_count
          (bs each; span_count -1: the request scores no prompt logprobs in this pass)
    device broadcast (FORWARD only; NCCL on CUDA, gloo on CPU; int64)
        input_ids [num_tokens] | out_cache_loc [num_tokens] | kv_indices [num_kv_tokens]

Rank 0 keeps the scheduler, the allocator and `req_to_token`; a worker's KV storage has the same
slot layout, so rank 0's `kv_indices` (its `req_to_token` rows of the batch, flattened) are all a
worker needs to find its heads' KV. Commands before `RUNNER` carry no batch (max_bs is 0 until
both sides know the pool sizes).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from lmnb.runtime.core import Batch, ForwardMode

if TYPE_CHECKING:
    from lmnb.runtime.forward_batch import ForwardBatch

HEADER = 8
_FIELDS = 6  # per-request int lists in the control buffer
_MODES = (ForwardMode.EXTEND, ForwardMode.DECODE)


class Command(enum.IntEnum):
    STOP = 0
    RUNNER = 1  # build the model runner (KV pools sized by the smallest device)
    CAPTURE = 2  # capture decode CUDA graphs up to batch `arg`
    FORWARD = 3


@dataclass(slots=True)
class Step:
    """One forward pass as a worker receives it."""

    mode: ForwardMode
    req_pool_indices: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    samples: list[bool]
    spans: list[tuple[int, int] | None]  # (first hidden row, rows) of prompt-logprob scoring
    input_ids: torch.Tensor
    out_cache_loc: torch.Tensor
    kv_indices: torch.Tensor


class Broadcasts(Protocol):
    """What the channel needs of its tensor-parallel group (`TPGroup`): rank 0's tensors
    broadcast in place to every rank, host ints over the control group, the rest on the
    device."""

    device: torch.device

    def broadcast_control(self, x: torch.Tensor) -> torch.Tensor: ...

    def broadcast_device(self, x: torch.Tensor) -> torch.Tensor: ...


class StepChannel:
    """Both ends of the per-step broadcast; rank 0 sends, the others receive."""

    def __init__(self, tp: Broadcasts) -> None:
        self.tp = tp
        self.max_bs = 0
        self._control = torch.zeros(HEADER, dtype=torch.int64)
        self.forwards_sent = 0
        self.send_seconds = 0.0  # rank 0's time in `send_forward` (host side)

    def reserve(self, max_bs: int) -> None:
        """Batches of up to `max_bs` requests from now on (every rank calls it alike)."""
        self.max_bs = max_bs
        self._control = torch.zeros(HEADER + _FIELDS * max_bs, dtype=torch.int64)

    # ---- rank 0 --------------------------------------------------------------------------------
    def _broadcast(self, message: list[int]) -> None:
        """The first len(message) ints of the control buffer (the rest is stale: unread)."""
        self._control[:len(message)] = torch.tensor(message, dtype=torch.int64)
        self.tp.broadcast_control(self._control)

    def send_command(self, command: Command, arg: int = 0) -> None:
        self._broadcast([int(command), 0, 0, 0, 0, arg, 0, 0])

    def send_forward(self, batch: Batch, forward_batch: ForwardBatch,
                     spans: Sequence[tuple[int, int] | None]) -> None:
        start = time.perf_counter()
        bs = batch.size
        if bs > self.max_bs:
            raise ValueError(f"a batch of {bs} requests exceeds the {self.max_bs} reserved")
        num_tokens, num_kv_tokens = forward_batch.num_tokens, forward_batch.num_kv_tokens
        message = [int(Command.FORWARD), _MODES.index(batch.mode), bs, num_tokens,
                   num_kv_tokens, 0, 0, 0,
                   *batch.req_pool_indices, *batch.prefix_lens, *batch.extend_lens,
                   *(int(s) for s in batch.samples),
                   *(-1 if s is None else s[0] for s in spans),
                   *(-1 if s is None else s[1] for s in spans)]
        self._broadcast(message)
        self.tp.broadcast_device(torch.cat((forward_batch.input_ids,
                                            forward_batch.out_cache_loc.to(torch.int64),
                                            forward_batch.kv_indices)))
        self.forwards_sent += 1
        self.send_seconds += time.perf_counter() - start

    # ---- ranks 1..N-1 --------------------------------------------------------------------------
    def receive(self) -> tuple[Command, int, Step | None]:
        """Blocks until rank 0 sends the next command: (command, arg, the step of a FORWARD)."""
        buffer = self.tp.broadcast_control(self._control)
        command, mode, bs, num_tokens, num_kv_tokens, arg = buffer[:6].tolist()
        command = Command(command)
        if command is not Command.FORWARD:
            return command, arg, None
        fields = buffer[HEADER:HEADER + _FIELDS * bs].view(_FIELDS, bs).tolist()
        pool, prefix, extend, samples, span_rows, span_counts = fields
        payload = torch.empty(2 * num_tokens + num_kv_tokens, dtype=torch.int64,
                              device=self.tp.device)
        self.tp.broadcast_device(payload)
        step = Step(
            mode=_MODES[mode], req_pool_indices=pool, prefix_lens=prefix, extend_lens=extend,
            samples=[bool(s) for s in samples],
            spans=[None if count < 0 else (row, count)
                   for row, count in zip(span_rows, span_counts, strict=True)],
            input_ids=payload[:num_tokens], out_cache_loc=payload[num_tokens:2 * num_tokens],
            kv_indices=payload[2 * num_tokens:])
        return command, arg, step
