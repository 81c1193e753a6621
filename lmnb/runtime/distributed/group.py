"""Tensor-parallel process groups: which rank this process is, the collectives the parallel layers
call, and the construction context that tells a model's layers which shard they hold.

    rank 0          the calling process (the notebook kernel): scheduler, sampling
    ranks 1..N-1    worker processes it spawned (`tp_worker.py`); rank r on cuda:(base + r)
    device group    torch.distributed's default group: NCCL on CUDA, gloo on CPU; activations
                    (all-reduce, vocab gather) and each step's device tensors
    control group   gloo over CPU tensors: setup and each step's header; a worker idles blocked
                    in its broadcast, so it has no timeout to speak of

Both groups meet through a `TCPStore` that rank 0 opens on a free port of 127.0.0.1.
`torch.distributed`'s default group is per process: one tensor-parallel Runtime at a time per
process; `close()` destroys it, so the next Runtime can create its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lmnb.runtime.distributed.step import StepChannel

# Collectives of a step: every rank is inside the same step, so only a stuck peer waits this long.
DEVICE_TIMEOUT = timedelta(minutes=30)
# A worker waits for the next step as long as the notebook stays idle (kept below 2**31 ms; an
# idle worker that times out exits, and the Runtime reports it at its next call).
CONTROL_TIMEOUT = timedelta(days=24)
STORE_HOST = "127.0.0.1"


class TPError(RuntimeError):
    """The tensor-parallel group cannot serve: a worker failed or died, or a step failed midway
    (the ranks no longer agree on where they are)."""


class TPGroup:
    """This process's place in the tensor-parallel group and the collectives over it. A model
    can be built for it (only `rank` and `size` are read then) before it `join`s the others."""

    def __init__(self, *, rank: int, size: int, device: torch.device) -> None:
        self.rank = rank
        self.size = size
        self.device = device
        self.control: Any = None
        self._initialized = False  # this object made torch.distributed's default group
        self.failure: BaseException | None = None
        self.health_check: Callable[[], None] | None = None  # rank 0: raises if a worker died
        self._gather_lists = device.type == "cpu"  # gloo: all_gather of a tensor list
        self.steps = StepChannel(self)  # commands and forward passes from rank 0

    # ---- collectives of the parallel layers (device group) -------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the ranks in place; returns it."""
        dist.all_reduce(x)
        return x

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[n, vocab_per_rank] logits of this rank's vocabulary shard -> [n, vocab_size], the
        shards side by side in rank order (the padding of the last shard dropped)."""
        n, per_rank = local.shape
        local = local.contiguous()
        if self._gather_lists:
            parts = [torch.empty_like(local) for _ in range(self.size)]
            dist.all_gather(parts, local)
            return torch.cat(parts, dim=1)[:, :vocab_size]
        gathered = torch.empty((self.size * n, per_rank), dtype=local.dtype, device=local.device)
        dist.all_gather_into_tensor(gathered, local)
        return gathered.view(self.size, n, per_rank).permute(1, 0, 2).reshape(
            n, self.size * per_rank)[:, :vocab_size]

    def broadcast_device(self, x: torch.Tensor) -> torch.Tensor:
        dist.broadcast(x, src=0)
        return x

    # ---- control group (CPU) -------------------------------------------------------------------
    def broadcast_control(self, x: torch.Tensor) -> torch.Tensor:
        dist.broadcast(x, src=0, group=self.control)
        return x

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. the KV tokens each device has room for)."""
        x = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(x, op=dist.ReduceOp.MIN, group=self.control)
        return int(x.item())

    def join(self, store: Any) -> TPGroup:
        """Meets the other ranks through `store` (every rank calls this) and forms the groups."""
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process; "
                               "tensor parallelism needs its own default group (close the "
                               "other tensor-parallel Runtime first)")
        cuda = self.device.type == "cuda"
        if cuda:
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (GPU hosts)
            torch.cuda.set_device(self.device)
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=self.rank,
                                world_size=self.size, timeout=DEVICE_TIMEOUT,
                                device_id=self.device if cuda else None)
        self._initialized = True
        self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        if cuda:  # create the NCCL communicator now, not inside a CUDA-graph capture
            self.all_reduce(torch.zeros(1, device=self.device))
            torch.cuda.synchronize(self.device)
        return self

    # ---- health --------------------------------------------------------------------------------
    def check(self) -> None:
        """Raises `TPError` when the group cannot serve (a dead worker, an earlier failure)."""
        if self.health_check is not None:
            self.health_check()
        if self.failure is not None:
            raise TPError(f"tensor parallelism failed: {self.failure}") from self.failure

    def fail(self, error: BaseException) -> None:
        """A step failed midway: every later step raises instead of meeting peers out of step."""
        if self.failure is None:
            self.failure = error

    def destroy(self) -> None:
        """Leaves the groups (the peers have stopped): NCCL communicators are aborted, which
        waits for no peer (a graceful destroy can hang once CUDA graphs captured collectives)."""
        if self._initialized and dist.is_initialized():
            if self.device.type == "cuda":
                self.abort()
            else:
                dist.destroy_process_group()
        self._initialized = False
        self.control = None

    def abort(self) -> None:
        """Unblocks collectives waiting on a dead peer (NCCL; gloo notices closed sockets) and
        forgets the groups."""
        if self.device.type == "cuda" and self._initialized and dist.is_initialized():
            dist.distributed_c10d._abort_process_group()


# ---- which shard a layer holds: read once, while the model is built ----------------------------
_BUILDING: ContextVar[TPGroup | None] = ContextVar("lmnb_tp_building", default=None)


@contextmanager
def building_with(tp: TPGroup | None) -> Iterator[None]:
    """Layers constructed inside hold rank `tp.rank`'s shard of `tp.size` (None: everything)."""
    token = _BUILDING.set(tp if tp is not None and tp.size > 1 else None)
    try:
        yield
    finally:
        _BUILDING.reset(token)


def current_tp() -> TPGroup | None:
    """The group of the model being built; None without tensor parallelism."""
    return _BUILDING.get()
