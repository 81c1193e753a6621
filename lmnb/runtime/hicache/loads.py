"""Host -> device KV loads overlapped with the forward, layer by layer (`KVStorage.pending`).

A load (host rows -> freshly allocated device rows) is queued while the scheduler plans a pass;
nothing is copied yet. The first reader of the device pool makes the queued loads one group and
issues its copies on a side stream, interleaved by layer, a few layers ahead of the one it waits
for (the issuing's host time is spread over the forward's):

    load stream:   [layer 0 of loads A, B] e0  [layer 1 of A, B] e1  ...  [layer L-1] e(L-1)
    compute:       embed ... wait e0, attention 0 ... wait e1, attention 1 ...

The attention backend calls `KVStorage.ready(l)` before it reads layer l (`AttentionBackend.
prepare_layer`): the compute stream waits for event l only, so layer l's copies hide behind the
compute of layers < l. Any other reader or re-user of the rows calls `settle()` first (all layers).

On CPU the same bookkeeping runs synchronously and lazily: `ready(l)` copies layer l right then,
so a reader that skipped `ready` would read rows not yet loaded (the tests would see it).

Timing (CUDA): per issued group, the copies' span (first copy to event L-1) and how long the
compute stream stood at each wait (from its arrival at `ready(l)` to event l, when later):
`waited_seconds` / `load_seconds` is the part of the loads the forward did not hide.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lmnb.runtime.memory import KVStorage

# Per layer: the host (k, v) rows of a load, in the order of its device slots; each a contiguous
# [n_i, kv_heads, head_dim] view (pinned on CUDA).
HostRows = Callable[[int], list[tuple[torch.Tensor, torch.Tensor]]]
LOOKAHEAD = 2  # layers whose copies are issued ahead of the one the forward waits for


@dataclass(slots=True)
class _Load:
    rows: HostRows
    slots: torch.Tensor  # [n] device slots
    tokens: int


@dataclass(slots=True)
class _Group:
    """Loads issued together (CUDA) or copied lazily layer by layer (CPU)."""

    loads: list[_Load]
    waited: list[bool]
    issued: int = 0  # layers whose copies are on the load stream (CUDA)
    slots: torch.Tensor | None = None  # every load's device slots, in order (CUDA)
    stage: tuple[torch.Tensor, torch.Tensor] | None = None  # device K, V rows of one layer
    events: list[torch.cuda.Event] = field(default_factory=list)  # per issued layer
    start: torch.cuda.Event | None = None
    arrivals: dict[int, torch.cuda.Event] = field(default_factory=dict)  # layer -> compute event


@dataclass(slots=True)
class LoadCounters:
    loads: int = 0  # groups issued (one per pass that loaded)
    tokens: int = 0
    load_seconds: float = 0.0  # the copies' span
    waited_seconds: float = 0.0  # the compute stream (CPU: the scheduler) waiting for them


class LayerLoads:
    def __init__(self, kv: KVStorage) -> None:
        self.kv = kv
        cuda = kv.device.type == "cuda"
        self.stream = torch.cuda.Stream(kv.device) if cuda else None
        self._queued: list[_Load] = []
        self._groups: list[_Group] = []  # issued, some layer not waited for yet
        self._timed: list[_Group] = []  # fully waited, timings not read yet (CUDA)
        self.counters = LoadCounters()

    # ---- the scheduler side --------------------------------------------------------------------
    def add(self, rows: HostRows, slots: torch.Tensor) -> None:
        """Queues a copy of `rows` into device rows `slots`; they may not be read before
        `ready(layer)` / `settle()`."""
        if len(slots):
            self._queued.append(_Load(rows, slots, len(slots)))
            self.kv.pending = self

    @property
    def busy(self) -> bool:
        """Loads are queued or not yet waited for."""
        return bool(self._queued or self._groups)

    def settle(self) -> None:
        """Every load so far is complete for the compute stream (CPU: done)."""
        self._group()
        for group in self._groups:
            for layer, waited in enumerate(group.waited):
                if not waited:
                    self._wait(group, layer)
        self._groups.clear()
        self.kv.pending = None

    def before_host_reuse(self, stream: torch.cuda.Stream | None) -> None:
        """Host rows are about to be overwritten (on `stream`): the loads so far read theirs
        first."""
        if not self.busy:
            return
        if self.stream is None:
            self.settle()
            return
        self._group()
        for group in self._groups:
            self._issue(group, self.kv.num_layers - 1)
        if stream is not None:
            stream.wait_stream(self.stream)

    # ---- the forward side (`KVStorage.ready`) --------------------------------------------------
    def wait_layer(self, layer: int) -> None:
        if self.stream is not None and torch.cuda.is_current_stream_capturing():
            return  # graph capture: no loads are pending then, and none may be recorded
        self._group()
        for group in self._groups:
            if not group.waited[layer]:
                self._wait(group, layer)
        self._groups = [g for g in self._groups if not all(g.waited)]
        if not self.busy:
            self.kv.pending = None

    # ---- copies --------------------------------------------------------------------------------
    def _group(self) -> None:
        """The queued loads become one group (copied together, layer by layer)."""
        if not self._queued:
            return
        loads, self._queued = self._queued, []
        if len(self._timed) > 64:
            self.read_counters()  # their events are long done
        self._groups.append(_Group(loads, [False] * self.kv.num_layers))
        self.counters.loads += 1
        self.counters.tokens += sum(load.tokens for load in loads)

    def _issue(self, group: _Group, through: int) -> None:
        """CUDA: puts the group's copies of layers up to `through` on the load stream."""
        assert self.stream is not None
        if group.issued > through:
            return
        device = self.kv.device
        compute = torch.cuda.current_stream(device)
        with torch.cuda.stream(self.stream):
            if group.slots is None:
                self.stream.wait_stream(compute)  # after the rows' earlier users (freed, saved)
                group.start = torch.cuda.Event(enable_timing=True)
                group.start.record(self.stream)
                for load in group.loads:
                    load.slots.record_stream(self.stream)
                group.slots = torch.cat([load.slots for load in group.loads])
                shape = (len(group.slots), self.kv.kv_heads, self.kv.head_dim)
                group.stage = (torch.empty(shape, dtype=self.kv.dtype, device=device),
                               torch.empty(shape, dtype=self.kv.dtype, device=device))
            stage_k, stage_v = group.stage
            for layer in range(group.issued, through + 1):
                offset = 0
                for load in group.loads:
                    for k, v in load.rows(layer):
                        n = len(k)
                        stage_k[offset:offset + n].copy_(k, non_blocking=True)
                        stage_v[offset:offset + n].copy_(v, non_blocking=True)
                        offset += n
                self.kv.k_buffers[layer][group.slots] = stage_k
                self.kv.v_buffers[layer][group.slots] = stage_v
                event = torch.cuda.Event(enable_timing=True)
                event.record(self.stream)
                group.events.append(event)
        group.issued = through + 1

    def _copy_layer(self, group: _Group, layer: int) -> None:
        """CPU: layer `layer` of the group's loads, now."""
        begin = time.perf_counter()
        k_buffer, v_buffer = self.kv.k_buffers[layer], self.kv.v_buffers[layer]
        for load in group.loads:
            offset = 0
            for k, v in load.rows(layer):
                part = load.slots[offset:offset + len(k)]
                k_buffer[part] = k
                v_buffer[part] = v
                offset += len(k)
        elapsed = time.perf_counter() - begin
        self.counters.load_seconds += elapsed
        self.counters.waited_seconds += elapsed  # nothing overlaps on the CPU

    def _wait(self, group: _Group, layer: int) -> None:
        group.waited[layer] = True
        if self.stream is None:
            self._copy_layer(group, layer)
            return
        self._issue(group, min(layer + LOOKAHEAD, self.kv.num_layers - 1))
        compute = torch.cuda.current_stream(self.kv.device)
        arrival = torch.cuda.Event(enable_timing=True)
        arrival.record(compute)
        group.arrivals[layer] = arrival
        compute.wait_event(group.events[layer])
        if all(group.waited):
            group.loads = []  # their copies are queued before every later use of their sources
            group.stage = None  # stream-ordered: reused only after the copies
            self._timed.append(group)

    # ---- timing --------------------------------------------------------------------------------
    def read_counters(self) -> LoadCounters:
        """The counters, with the timings of every group waited for so far (CUDA: waits for
        their events, long done by then)."""
        timed, self._timed = self._timed, []
        for group in timed:
            last = group.events[-1]
            last.synchronize()
            for arrival in group.arrivals.values():
                arrival.synchronize()
            self.counters.load_seconds += group.start.elapsed_time(last) / 1e3
            self.counters.waited_seconds += sum(
                max(group.arrivals[layer].elapsed_time(event), 0.0)
                for layer, event in enumerate(group.events)) / 1e3
        return self.counters
