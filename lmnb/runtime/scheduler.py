"""Continuous batching on one thread: admission under a token budget, chunked prefill, decode,
retraction when KV runs out, abort at any time.

Every request is in exactly one place: `waiting` (no KV), `chunked` (part of its prompt prefilled),
or `running` (prompt prefilled, decoding). All state here is touched by the scheduler thread only;
other threads talk to it through `submit`, `abort` and `call`.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch

from lmnb.runtime.core import (
    Batch,
    ForwardMode,
    Req,
    finish_abort,
    finish_length,
    finish_stop,
)
from lmnb.runtime.fsm.jump import JumpForward
from lmnb.runtime.model_runner import ModelRunner, StepOutput
from lmnb.runtime.policy import SchedulePolicy
from lmnb.runtime.prefix_cache import PrefixCache, common_prefix_length

logger = logging.getLogger(__name__)

OutputSink = Callable[[Req, str, list[int]], None]


class IntegrityError(AssertionError):
    pass


@dataclass(slots=True)
class SchedulerConfig:
    chunked_prefill_size: int = 2048  # most prompt tokens prefilled in one pass
    init_new_token_ratio: float = 0.7  # share of max_new_tokens reserved for running requests
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001  # per decode pass
    in_batch_prefix_min_tokens: int = 32  # defer a request sharing this many uncached tokens
    check_integrity_each_step: bool = False

    def __post_init__(self) -> None:
        if self.chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size must be >= 1, got {self.chunked_prefill_size}")


class Scheduler:
    def __init__(self, runner: ModelRunner, cache: PrefixCache, policy: SchedulePolicy,
                 config: SchedulerConfig, eos_token_ids: set[int],
                 jump_forward: JumpForward | None = None, recent_window: int = 64) -> None:
        self.runner = runner
        self.cache = cache
        self.policy = policy
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.jump_forward = jump_forward
        self.req_to_token_pool = runner.req_to_token_pool
        self.kv_pool = runner.token_to_kv_pool
        self.waiting: list[Req] = []
        self.chunked: Req | None = None
        self.running: list[Req] = []
        self.new_token_ratio = config.init_new_token_ratio
        self.stats = {"forward_passes": 0, "retractions": 0, "prompt_tokens": 0,
                      "cached_tokens": 0, "generated_tokens": 0, "jump_forward_tokens": 0}
        self.recent_hits: deque[tuple[int, int]] = deque(maxlen=recent_window)
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._stopped = threading.Event()
        self.fatal_error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="lmnb-scheduler", daemon=True)
        self._thread.start()

    # ---- other threads -------------------------------------------------------------------
    def submit(self, req: Req) -> None:
        self._inbox.put(("add", req))

    def abort(self, req: Req, message: str = "aborted") -> None:
        self._inbox.put(("abort", (req, message)))

    def call(self, fn: Callable[[], Any]) -> Any:
        """Runs `fn` on the scheduler thread between passes and returns its result."""
        if self._stopped.is_set():
            raise RuntimeError("the runtime is closed")
        future: Future = Future()
        self._inbox.put(("call", (fn, future)))
        while True:
            try:
                return future.result(timeout=0.5)
            except FutureTimeout:
                if not self._thread.is_alive() and not future.done():
                    raise RuntimeError("the runtime is closed") from None

    def stop(self) -> None:
        self._stopped.set()
        self._inbox.put(("wake", None))
        self._thread.join()

    # ---- scheduler thread ----------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopped.is_set():
            idle = not (self.waiting or self.running or self.chunked)
            self._drain_inbox(block=idle)
            if self._stopped.is_set():
                break
            try:
                worked = self.step()
            except BaseException as error:  # keep serving; never leave callers hanging
                logger.exception("scheduler step failed")
                self._fail_all(error)
                continue
            if not worked and (self.waiting or self.running or self.chunked):
                self._drain_inbox(block=True)  # nothing schedulable now: wait for news
        self._abort_everything("the runtime was closed")
        self._refuse_pending_calls()

    def _refuse_pending_calls(self) -> None:
        """Calls that raced with `stop` fail instead of waiting forever."""
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "call":
                payload[1].set_exception(RuntimeError("the runtime is closed"))
            elif kind == "add":
                self._finish(payload, finish_abort("the runtime was closed"), cache_kv=False)

    def _drain_inbox(self, *, block: bool) -> None:
        try:
            message = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*message)
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "add":
            payload.arrival_pass = self.stats["forward_passes"]
            self.waiting.append(payload)
        elif kind == "abort":
            req, message = payload
            self._abort(req, message)
        elif kind == "call":
            fn, future = payload
            try:
                future.set_result(fn())
            except BaseException as error:
                future.set_exception(error)

    def step(self) -> bool:
        """One forward pass if there is work; returns whether one ran."""
        batch = self._schedule_extend() or self._schedule_decode()
        if batch is None:
            return False
        try:
            output = self.runner.run(batch)
        except Exception as error:
            logger.exception("forward pass failed")
            for req in batch.reqs:
                self._detach(req)
                self._finish(req, finish_abort(f"forward pass failed: {error!r}"), cache_kv=False)
            return True
        self.stats["forward_passes"] += 1
        self._process(batch, output)
        if self.config.check_integrity_each_step:
            self.check_integrity()
        return True

    # ---- admission -----------------------------------------------------------------------
    def _reserved_for_running(self) -> int:
        reserve = 0.0
        for req in self.running:
            remaining = req.sampling_params.max_new_tokens - len(req.output_ids)
            reserve += max(remaining, 0) * self.new_token_ratio
        return int(reserve)

    def _schedule_extend(self) -> Batch | None:
        budget = self.config.chunked_prefill_size
        reserved = self._reserved_for_running()
        planned = 0  # tokens this batch allocates plus the reserves of the requests it admits

        def room() -> int:
            return self.kv_pool.available() + self.cache.evictable_size() - reserved - planned

        reqs: list[Req] = []
        prefix_lens: list[int] = []
        extend_lens: list[int] = []
        if self.chunked is not None:
            req = self.chunked
            remaining = req.fill_len - req.kv_len
            take = min(remaining, budget, max(room(), 0))
            if take <= 0:
                return None
            reqs.append(req)
            prefix_lens.append(req.kv_len)
            extend_lens.append(take)
            budget -= take
            planned += take
            if take < remaining:
                return self._make_batch(ForwardMode.EXTEND, reqs, prefix_lens, extend_lens)
            self.chunked = None
        for req in self.policy.order(self.waiting, self.cache, self.stats["forward_passes"]):
            if budget <= 0 or self.req_to_token_pool.available() == 0:
                break
            match = self._match(req)
            prefix_len = len(match.indices)
            if self._defer_for_shared_prefix(req, prefix_len, reqs):
                continue
            self._bind(req, match)  # locks the prefix: it no longer counts as evictable room
            extend = req.fill_len - prefix_len
            reserve = int(max(req.sampling_params.max_new_tokens - len(req.output_ids), 0)
                          * self.new_token_ratio)
            alone = not (self.running or reqs)  # admitted even if its reserve does not fit
            available = room()
            take = min(extend, budget, available)
            if (extend + reserve > available and not alone) or take <= 0:
                self._unbind(req)
                break
            self.waiting.remove(req)
            self._count_admission(req, prefix_len)
            reqs.append(req)
            prefix_lens.append(prefix_len)
            extend_lens.append(take)
            budget -= take
            planned += take + reserve
            if take < extend:
                self.chunked = req
                break
        if not reqs:
            return None
        return self._make_batch(ForwardMode.EXTEND, reqs, prefix_lens, extend_lens)

    def _defer_for_shared_prefix(self, req: Req, cached_len: int, admitted: list[Req]) -> bool:
        """Holds back a request whose uncached prefix an admitted one is about to compute: once
        that one's prompt is in the cache, this one hits it."""
        threshold = self.config.in_batch_prefix_min_tokens
        if not self.cache.reuses_kv or threshold <= 0:
            return False
        ids = req.fill_ids
        uncached = len(ids) - cached_len
        for other in admitted:
            if other.extra_key != req.extra_key:
                continue
            shared = common_prefix_length(ids, other.fill_ids) - cached_len
            # Long shared runs pay off; so does a whole shared prompt (e.g. the n samples).
            if shared >= threshold or (shared > 0 and shared >= uncached - 1):
                return True
        return False

    def _match(self, req: Req):
        key = req.fill_ids
        if req.wants_input_logprobs:
            key = key[:max(req.input_logprobs_needed_from, 1)]  # scored positions must be computed
        return self.cache.match_prefix(key, req.extra_key)

    def _bind(self, req: Req, match) -> None:
        req.req_pool_idx = self.req_to_token_pool.alloc()
        prefix = match.indices
        self.cache.inc_lock_ref(match.last_node)
        req.prefix_indices = prefix
        req.last_node = match.last_node
        req.kv_len = len(prefix)
        self.req_to_token_pool.req_to_token[req.req_pool_idx, :len(prefix)] = prefix

    def _unbind(self, req: Req) -> None:
        self.cache.dec_lock_ref(req.last_node)
        self._release_slots(req)

    def _count_admission(self, req: Req, prefix_len: int) -> None:
        if not req.admitted:
            req.admitted = True
            req.cached_tokens = prefix_len
            self.stats["prompt_tokens"] += len(req.origin_input_ids)
            self.stats["cached_tokens"] += prefix_len
            self.recent_hits.append((prefix_len, len(req.origin_input_ids)))
            if prefix_len:
                self.cache.note_hit(req.last_node)
        if req.wants_input_logprobs and req.logprob_start_len == 0 and not req.input_token_logprobs:
            req.input_token_logprobs.append((None, req.origin_input_ids[0]))
            req.input_top_logprobs.append(None)

    def _alloc(self, n: int) -> torch.Tensor:
        short = n - self.kv_pool.available()
        if short > 0:
            self.cache.evict(short)
        return self.kv_pool.alloc(n)

    def _make_batch(self, mode: ForwardMode, reqs: list[Req], prefix_lens: list[int],
                    extend_lens: list[int]) -> Batch:
        out_cache_loc = self._alloc(sum(extend_lens))
        table = self.req_to_token_pool.req_to_token
        start = 0
        samples = []
        for req, prefix_len, extend_len in zip(reqs, prefix_lens, extend_lens, strict=True):
            table[req.req_pool_idx, prefix_len:prefix_len + extend_len] = \
                out_cache_loc[start:start + extend_len]
            start += extend_len
            req.kv_len = prefix_len + extend_len  # the slots are the request's from now on
            completes = req.kv_len == req.fill_len
            samples.append(completes and req.sampling_params.max_new_tokens > len(req.output_ids))
        return Batch(mode=mode, reqs=reqs, prefix_lens=prefix_lens, extend_lens=extend_lens,
                     out_cache_loc=out_cache_loc, samples=samples)

    # ---- decode --------------------------------------------------------------------------
    def _schedule_decode(self) -> Batch | None:
        if not self.running:
            return None
        if self.kv_pool.available() + self.cache.evictable_size() < len(self.running):
            self._retract_until_decodable()
        self.new_token_ratio = max(self.new_token_ratio - self.config.new_token_ratio_decay,
                                   self.config.min_new_token_ratio)
        reqs = list(self.running)
        return self._make_batch(ForwardMode.DECODE, reqs, [r.kv_len for r in reqs],
                                [1] * len(reqs))

    def _retract_until_decodable(self) -> None:
        """Preempts requests (recompute later) until every remaining one can decode a token."""
        victims = sorted(self.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        while len(self.running) > 1 and (
                self.kv_pool.available() + self.cache.evictable_size() < len(self.running)):
            victim = victims.pop(0)
            self.running.remove(victim)
            self.cache.cache_finished_req(victim)
            self._release_slots(victim)
            victim.retractions += 1
            self.stats["retractions"] += 1
            self.waiting.insert(0, victim)
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.2)

    # ---- results -------------------------------------------------------------------------
    def _process(self, batch: Batch, output: StepOutput) -> None:
        extend = batch.mode is ForwardMode.EXTEND
        for i, req in enumerate(batch.reqs):
            req.forward_passes += 1
            if output.input_logprobs[i]:
                req.input_token_logprobs.extend(output.input_logprobs[i])
                req.input_top_logprobs.extend(output.input_top_logprobs[i])
            token = output.next_token_ids[i]
            if token is not None:
                if extend:
                    self.running.append(req)
                self._append_token(req, token, output.next_token_logprobs[i],
                                   output.next_top_logprobs[i])
            elif req.kv_len == req.fill_len:  # prompt done, nothing to generate
                self._finish(req, finish_length(len(req.output_ids)))
            if extend and req.req_pool_idx is not None:  # still live, not jumped
                # Computed prompt KV goes into the cache at once, so that requests sharing the
                # prefix can hit it while this one still runs.
                self.cache.cache_unfinished_req(req)

    def _append_token(self, req: Req, token: int, logprob: float | None,
                      top: list[tuple[float, int]] | None) -> None:
        req.output_ids.append(token)
        self.stats["generated_tokens"] += 1
        if req.return_logprob:
            req.output_token_logprobs.append((logprob, token))
            if req.top_logprobs_num:
                req.output_top_logprobs.append(top or [])
        params = req.sampling_params
        past_min = len(req.output_ids) > params.min_new_tokens
        if past_min and ((token in self.eos_token_ids and not params.ignore_eos)
                         or token in params.stop_token_ids):
            self._finish(req, finish_stop(token))
            return
        if req.grammar is not None:
            req.grammar.advance(token)
        delta = req.detokenizer.add([token]) if req.detokenizer is not None else ""
        self._emit(req, delta, [token])
        if not self._finish_if_done(req) and req.grammar is not None and self.jump_forward:
            self._jump_forward(req)

    def _finish_if_done(self, req: Req) -> bool:
        """Ends the request on a stop string, its length limit or a completed constraint."""
        # Stop strings apply from the first token: min_new_tokens holds back EOS and stop ids only.
        if req.detokenizer is not None and req.detokenizer.matched_stop is not None:
            self._finish(req, finish_stop(req.detokenizer.matched_stop))
        elif req.grammar is not None and (req.grammar.is_final or req.grammar.is_dead):
            self._finish(req, finish_stop(None))
        elif len(req.output_ids) >= req.sampling_params.max_new_tokens:
            self._finish(req, finish_length(len(req.output_ids)))
        else:
            return False
        return True

    def _jump_forward(self, req: Req) -> None:
        """Compressed-FSM jump: text the constraint forces is appended at once. The output is
        re-tokenized as a whole; the request leaves the running batch (its KV goes to the prefix
        cache) and is prefilled again, reusing the KV of the unchanged prefix."""
        forced = req.grammar.forced_text()
        if not forced:
            return
        plan = self.jump_forward.plan(req.origin_input_ids, req.output_ids, forced)
        if plan is None or len(plan.new_output_ids) > req.sampling_params.max_new_tokens:
            return  # past max_new_tokens (which also keeps the context length): decode instead
        self.running.remove(req)
        self.cache.cache_finished_req(req)  # keyed by the old output ids
        self._release_slots(req)
        req.output_ids = list(plan.new_output_ids)
        if req.return_logprob:  # re-tokenized tokens were not sampled: they have no logprob
            appended = [(None, token) for token in plan.appended]
            req.output_token_logprobs = req.output_token_logprobs[:plan.keep] + appended
            if req.top_logprobs_num:
                req.output_top_logprobs = (req.output_top_logprobs[:plan.keep]
                                           + [[] for _ in plan.appended])
        req.grammar.advance_text(forced)
        req.jumps += 1
        self.stats["jump_forward_tokens"] += len(plan.appended)
        old = req.detokenizer
        emitted = old.text
        req.detokenizer = type(old)(old.tokenizer, req.origin_input_ids,
                                    skip_special_tokens=old.skip_special_tokens, stop=old.stop)
        text = req.detokenizer.add(req.output_ids)
        self._emit(req, text[len(emitted):] if text.startswith(emitted) else "", plan.appended)
        if not self._finish_if_done(req):
            self.waiting.insert(0, req)

    def _emit(self, req: Req, delta: str, new_ids: list[int]) -> None:
        if req.sink is not None:
            req.sink(req, delta, new_ids)

    def _finish(self, req: Req, reason: dict[str, Any], *, cache_kv: bool = True) -> None:
        """Ends a request: its KV goes to the cache (or is freed) and its sink gets the end."""
        if req in self.running:
            self.running.remove(req)
        if req.req_pool_idx is not None:
            if cache_kv:
                self.cache.cache_finished_req(req)
            else:
                owned = self.req_to_token_pool.req_to_token[
                    req.req_pool_idx, req.kv_len - req.owned_kv_len:req.kv_len]
                self.kv_pool.free(owned.clone())
                self.cache.dec_lock_ref(req.last_node)
            self._release_slots(req)
        req.finished_reason = reason
        tail = req.detokenizer.finish() if req.detokenizer is not None else ""
        self._emit(req, tail, [])

    def _release_slots(self, req: Req) -> None:
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.prefix_indices = None
        req.last_node = None
        req.kv_len = 0

    def _detach(self, req: Req) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        if self.chunked is req:
            self.chunked = None

    def _abort(self, req: Req, message: str) -> None:
        if req.finished:
            return
        self._detach(req)
        self._finish(req, finish_abort(message), cache_kv=False)

    def _abort_everything(self, message: str) -> None:
        for req in [*self.waiting, *self.running, *([self.chunked] if self.chunked else [])]:
            self._abort(req, message)

    def _fail_all(self, error: BaseException) -> None:
        self.fatal_error = error
        self._abort_everything(f"scheduler error: {error!r}")

    # ---- accounting ----------------------------------------------------------------------
    def live_reqs(self) -> list[Req]:
        return [*self.running, *([self.chunked] if self.chunked else [])]

    def check_integrity(self) -> None:
        """KV slots are conserved: free + evictable + protected + owned by requests == total."""
        owned = sum(req.owned_kv_len for req in self.live_reqs())
        free = self.kv_pool.available()
        evictable = self.cache.evictable_size()
        protected = self.cache.protected_size()
        total = self.kv_pool.size
        if free + evictable + protected + owned != total:
            raise IntegrityError(
                f"KV slots leaked: free {free} + evictable {evictable} + protected {protected} + "
                f"owned {owned} != total {total}")
        used_req_slots = self.req_to_token_pool.size - self.req_to_token_pool.available()
        if used_req_slots != len(self.live_reqs()):
            raise IntegrityError(
                f"request slots leaked: {used_req_slots} in use, {len(self.live_reqs())} live")
        if any(req.req_pool_idx is not None for req in self.waiting):
            raise IntegrityError("a waiting request still holds KV")
