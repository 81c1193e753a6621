"""One scheduler step: admit (prefill manager) or decode (decode manager) -> build a plain-data
`Batch` -> run the model -> process the outputs (stop rules, jump-forward, KV to the cache) ->
one batch of `TokenEvent`s to the sink.

`step()` is synchronous and touches no thread: tests call it directly; `SchedulerThread` is the
loop that calls it in the engine.

Overlap (`overlap_schedule`, with a runner that can `launch`): a pass is launched and left in
flight; the next `step()` builds and launches the following pass (`overlap.py`: the next decode
pass of the same requests, whose input ids are the tokens still on the device, or the next
prefill pass) *before* it waits for and processes the one in flight, so the host's scheduling and
output work hides behind the device's. A request that ends in the pass being processed was
already in the next one: that pass's token for it is dropped (its KV slot holds the KV of its
last real token and is cached with it). A prefill pass's prompts go into the prefix cache when it
is launched (or run), so the next pass's admission does not wait for its results.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from lmnb.runtime.core import (
    Batch,
    ForwardMode,
    InputLogprobSpan,
    Req,
    ReqStatus,
    StepOutput,
    VerifyOutput,
    finish_abort,
    finish_length,
)
from lmnb.runtime.output.detokenizer import Decoder
from lmnb.runtime.output.events import TokenEvent
from lmnb.runtime.output.stop import StopRules
from lmnb.runtime.output.stop_text import StopText
from lmnb.runtime.output.token_origins import GENERATED, JUMP_FORWARD, accept_speculated
from lmnb.runtime.policy import SchedulePolicy
from lmnb.runtime.scheduler.cache_manager import CacheManager
from lmnb.runtime.scheduler.contracts import (
    JumpPlanner,
    OutputSink,
    SchedulerConfig,
    Speculator,
    StepRunner,
    VerifyRunner,
)
from lmnb.runtime.scheduler.decode import DecodeManager
from lmnb.runtime.scheduler.media_log import MediaLog
from lmnb.runtime.scheduler.overlap import (
    InFlight,
    decode_after_prefill,
    decode_followers,
    going_on,
    may_follow_extend,
)
from lmnb.runtime.scheduler.prefill import PrefillManager, input_logprob_span, samples_after_fill
from lmnb.runtime.scheduler.profiler import PassProfiler
from lmnb.runtime.scheduler.request_state import ReqState
from lmnb.runtime.scheduler.request_table import RequestTable
from lmnb.runtime.scheduler.stats import (
    SchedulerStats,
    admission_meta,
    live_meta,
    request_meta,
)

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, *, runner: StepRunner, cache: CacheManager, policy: SchedulePolicy,
                 config: SchedulerConfig, stop_rules: StopRules, sink: OutputSink,
                 tokenizer: Decoder | None = None, jump_forward: JumpPlanner | None = None,
                 vocab_size: int | None = None, speculator: Speculator | None = None,
                 verifier: VerifyRunner | None = None) -> None:
        if (speculator is None) != (verifier is None):
            raise ValueError("a speculator needs a verifier (the runner's verify pass)")
        self.runner = runner
        self.cache = cache
        self.config = config
        self.stop_rules = stop_rules
        self.sink = sink
        self.tokenizer = tokenizer
        self.jump_forward = jump_forward
        self.speculator = speculator
        self.verifier = verifier
        self.table = RequestTable()
        self.decode = DecodeManager(cache, init_new_token_ratio=config.init_new_token_ratio,
                                    min_new_token_ratio=config.min_new_token_ratio,
                                    new_token_ratio_decay=config.new_token_ratio_decay,
                                    exact_length_admission=config.exact_length_admission)
        self.prefill = PrefillManager(cache, policy, budget=config.chunked_prefill_size,
                                      in_batch_prefix_min_tokens=config.in_batch_prefix_min_tokens,
                                      length_known=self.decode.length_known)
        self.stats = SchedulerStats()
        self.media = MediaLog(vocab_size if vocab_size is not None else 1 << 31)
        self.batch_hook: Callable[[Batch], None] | None = None  # sees every batch that ran
        self.profiler = PassProfiler()  # `/start_profile`: traces passes, counts them
        self._events: list[TokenEvent] = []
        # Requests a decode pass finished whose KV goes to the cache once their ends are sent
        # (`_complete`): a pass that ends hundreds of requests hands them their results first.
        self._ended_kv: list[Req] = []
        self._in_flight: InFlight | None = None
        self._shared_rids: list[int] = []
        self._shared: list[tuple[int, list[int]]] = []

    # ---- requests in and out ------------------------------------------------------------------
    def add(self, state: ReqState) -> None:
        state.req.arrival_pass = self.stats.forward_passes
        if state.stop_text is None and StopText.wanted(state.sampling_params):
            state.stop_text = StopText(self.tokenizer, state.req.text_prompt_ids,
                                       state.sampling_params)
        self.table.add(state)
        if self.cache.cache.prefetches:
            self.cache.prefetched(state.req)  # a tiered cache starts reading its disk pages

    def abort(self, rid: int, message: str = "aborted") -> bool:
        """Ends request `rid` (waiting, mid-prefill or decoding), freeing its KV; False if it is
        not live."""
        state = self.table.get(rid)
        if state is None:
            return False
        self._finish(state, finish_abort(message), cache_kv=False)
        self._flush()
        return True

    def abort_all(self, message: str) -> None:
        """Ends every live request (after a scheduler error, or at close), draining a pass in
        flight first. If that pass fails too and is a prefill pass, the prompts it cached at
        launch hold KV never written: once the requests have let go of them, the unlocked
        entries are dropped, as after any failed prefill pass (`_void_pipeline`)."""
        void = self._drain_in_flight()
        while self._ended_kv:  # ended, their KV not yet handed over (a failed step): freed
            self.cache.free(self._ended_kv.pop())
        for req in self.table.all():
            self._finish(self.table.states[req.rid], finish_abort(message), cache_kv=False)
        self._flush()
        if void:
            self.cache.drop_unlocked()

    @property
    def has_work(self) -> bool:
        return bool(self.table.states) or self._in_flight is not None

    def report(self) -> dict[str, Any]:
        """The scheduler's part of `Runtime.stats()`: its counters (hit rates, passes,
        retractions, ...), the overlap mode and the requests running and waiting."""
        return {**self.stats.counters(), "overlap_schedule": self.config.overlap_schedule,
                "running": len(self.table.running), "waiting": len(self.table.waiting),
                "speculative": self.speculator.report() if self.speculator else None}

    @property
    def pass_in_flight(self) -> bool:
        """A launched pass awaits processing (overlap)."""
        return self._in_flight is not None

    # ---- one step -----------------------------------------------------------------------------
    def step(self) -> bool:
        """One forward pass if there is work; returns whether one ran (or was processed)."""
        if self._in_flight is not None:
            self._step_pipelined()
            return True
        live = len(self.table.states)
        scheduled = self._schedule_extend() or self._schedule_decode()
        if scheduled is None:  # requests ended while planning (no room, a failed load): worked
            return len(self.table.states) < live or self._end_what_cannot_fit()
        batch, reqs = scheduled
        rows = self._rows(batch, reqs)
        if self._may_pipeline(batch, rows):
            self._launch(batch, reqs, rows)
            return True
        start = time.perf_counter()
        try:
            if batch.is_verify and self.verifier is not None:
                output: StepOutput | VerifyOutput = self.verifier.verify(batch, rows)
            else:
                output = self.runner.run(batch, rows)
        except Exception as error:
            self._fail(reqs, error)
            return True
        if self.speculator is not None:
            self.speculator.timed(batch, time.perf_counter() - start)
        self._cache_prompts(batch, reqs)
        self._complete(batch, reqs, output)
        return True

    def _end_what_cannot_fit(self) -> bool:
        """Nothing could be planned and nothing runs: the request the plan would take first (the
        one part-prefilled, else the head of the policy's order) found no room even alone, so
        the free and evictable slots cannot hold it (pinned prefixes hold the rest); it would
        wait forever and hold the queue: it ends with an error. Returns whether one ended."""
        table, cache = self.table, self.cache
        if self._in_flight is not None or table.running or table.prefilling:
            return False
        if table.chunked is not None:
            req, done = table.chunked, table.chunked.kv_len
        else:
            ordered = [req for req in self.prefill.policy.order(
                table.waiting, cache.cache, self.stats.forward_passes) if cache.prefetched(req)]
            if not ordered:
                return False  # its disk pages are being read
            req = ordered[0]
            done = cache.match(req).length
        need = req.fill_len - done + 1  # the rest of the prompt and a first output token
        self._finish(table.states[req.rid], finish_abort(self._no_room(need)))
        self._flush()
        return True

    def _no_room(self, need: int) -> str:
        cache = self.cache
        return (f"out of KV cache: {need} more slots needed, {cache.room()} free or evictable of "
                f"{cache.allocator.size} ({cache.cache.protected_size()} held by pinned prefixes "
                "and live requests); unpin prefixes or raise max_total_tokens")

    def _rows(self, batch: Batch, reqs: list[Req]) -> list[ReqState]:
        return [self.table.states[req.rid] for req, s in zip(reqs, batch.samples, strict=True)
                if s]

    def _may_pipeline(self, batch: Batch, rows: list[ReqState]) -> bool:
        if not self.config.overlap_schedule:
            return False
        if batch.mode is ForwardMode.DECODE:
            return all(row.grammar is None for row in rows)
        return self.config.overlap_extend and not batch.is_verify

    def _launch(self, batch: Batch, reqs: list[Req], rows: list[ReqState]) -> None:
        try:
            pending = self.runner.launch(batch, rows)
        except Exception as error:
            self._fail(reqs, error)
            return
        self._in_flight = InFlight(batch, reqs, pending)
        self._cache_prompts(batch, reqs)  # while the device works on the pass

    def _cache_prompts(self, batch: Batch, reqs: list[Req]) -> None:
        """A prefill pass's prompts (so far) into the prefix cache, once it is launched."""
        if batch.mode is ForwardMode.EXTEND and not batch.is_verify:
            self.cache.cache_pass(reqs, batch.extend_lens, batch.out_cache_loc)

    def _step_pipelined(self) -> None:
        """Launch the next pass (when it may follow), then process the one in flight."""
        current, self._in_flight = self._in_flight, None
        try:
            following = (self._following_extend(current) or self._following_decode(current)
                         or self._decode_after_prefill(current))
        except BaseException:  # still in flight: `abort_all` drains it
            self._in_flight = current
            raise
        if following is not None:
            batch, reqs = following
            if current.is_prefill:
                self.stats.overlapped_prefill_passes += 1
            else:
                self.stats.overlapped_passes += 1
            self._launch(batch, reqs, self._rows(batch, reqs))
        try:
            output = current.pending.result()
        except Exception as error:
            self._void_pipeline(current, error)
            return
        self._complete(current.batch, current.reqs, output)

    def _void_pipeline(self, current: InFlight, error: Exception) -> None:
        """The pass in flight failed: it and the pass launched after it (which read its tokens
        or KV) end their requests with the error."""
        following = self._in_flight
        self._drain_in_flight()
        self._fail([*current.reqs, *(following.reqs if following else [])], error)
        if current.is_prefill or (following is not None and following.is_prefill):
            self.cache.drop_unlocked()  # prompts cached at launch: their KV is void

    def _following_extend(self, current: InFlight) -> tuple[Batch, list[Req]] | None:
        if not (self.config.overlap_extend and may_follow_extend(current, self.table)):
            return None
        return self._schedule_extend(also_running=going_on(current) if current.is_prefill else ())

    def _decode_after_prefill(self, current: InFlight) -> tuple[Batch, list[Req]] | None:
        """With a speculator, the first decode step after prefill is its to plan (`propose`)."""
        following = (decode_after_prefill(current, self.table, room=self.cache.room())
                     if self.config.overlap_extend and self.speculator is None else None)
        if following is None:
            return None
        reqs, previous_rows = following
        self.decode.decayed()
        return self._make_batch(ForwardMode.DECODE, reqs, [1] * len(reqs),
                                follows_previous=True, previous_rows=previous_rows), reqs

    def _following_decode(self, current: InFlight) -> tuple[Batch, list[Req]] | None:
        """The next decode pass of the requests in flight that go on past it, if nothing stands
        in its way (`overlap.decode_followers`; drafts need the token in flight)."""
        followers = decode_followers(current, self.table, room=self.cache.room())
        if followers is None:
            return None
        reqs, previous_rows = followers
        if self.speculator is not None and self.speculator.may_draft(
                [self.table.states[req.rid] for req in reqs]):
            return None
        self.decode.decayed()
        return self._make_batch(ForwardMode.DECODE, reqs, [1] * len(reqs),
                                follows_previous=True, previous_rows=previous_rows), reqs

    def _drain_in_flight(self) -> bool:
        """Waits for a pass in flight and drops its results (its requests are being ended).
        Returns whether it was a prefill pass that failed (the prompts it cached at launch hold
        KV never written)."""
        current, self._in_flight = self._in_flight, None
        if current is None:
            return False
        try:
            current.pending.result()
        except Exception:  # its requests are ended by the caller
            return current.is_prefill
        return False

    def _fail(self, reqs: list[Req], error: Exception) -> None:
        logger.exception("forward pass failed")
        for req in reqs:
            state = self.table.states.get(req.rid)
            if state is not None:
                self._finish(state, finish_abort(f"forward pass failed: {error!r}"),
                             cache_kv=False)
        self._flush()

    def _complete(self, batch: Batch, reqs: list[Req], output: StepOutput | VerifyOutput
                  ) -> None:
        self.stats.forward_passes += 1
        if self.batch_hook is not None:
            self.batch_hook(batch)
        self.profiler.passed()
        try:
            self._process(batch, reqs, output)
        finally:  # a failure mid-pass (the loop then aborts the rest) still ends what ended
            self._flush()
            self._hand_ended_kv_to_cache()
        if self.config.check_integrity_each_step:
            self.check_integrity()

    def _schedule_extend(self, also_running: Sequence[Req] = ()
                         ) -> tuple[Batch, list[Req]] | None:
        """The next prefill pass; `also_running`: requests of a pass in flight that will
        decode (their KV reserve counts)."""
        table = self.table
        if not table.waiting and table.chunked is None:
            return None
        running = [*table.running, *also_running]
        plan = self.prefill.plan(
            table.waiting, table.chunked, reserved=self.decode.reserved(running),
            known=self.decode.known_peak(running),
            any_running=bool(running), new_token_ratio=self.decode.new_token_ratio,
            clock=self.stats.forward_passes)
        if plan is None:
            return None
        for req, error in plan.failed:
            logger.error("loading the cached prefix of request %s back failed: %r", req.rid,
                         error)
            self._finish(table.states[req.rid],
                         finish_abort(f"loading its cached prefix back failed: {error!r}"),
                         cache_kv=False)
        if plan.failed:
            self._flush()
        if not plan.reqs:
            return None
        admitted = set(map(id, plan.admitted))
        table.waiting[:] = [req for req in table.waiting if id(req) not in admitted]
        for req in plan.admitted:
            self._count_admission(req)
        table.chunked = plan.chunked
        for req in plan.reqs:
            req.status = ReqStatus.PREFILLING
            if req is not plan.chunked:
                table.prefilling[req.rid] = req
        return self._make_batch(ForwardMode.EXTEND, plan.reqs, plan.extend_lens), plan.reqs

    def _schedule_decode(self) -> tuple[Batch, list[Req]] | None:
        running = self.table.running
        if not running:
            return None
        chunked = self.table.chunked
        retracted = self.decode.retract_until_decodable(running, chunked)
        if retracted and retracted[-1] is chunked:
            self.table.chunked = None
        for req in reversed(retracted):
            self.stats.retractions += 1
            self.table.requeue_front(req)
        if self.cache.room() < len(running):  # one request, and pinned prefixes hold the rest
            for req in running[self.cache.room():]:
                self._finish(self.table.states[req.rid], finish_abort(self._no_room(1)))
            self._flush()
            if not running:
                return None
        self.decode.decayed()
        reqs = list(running)
        if self.speculator is not None:
            drafts = self.speculator.propose(
                [self.table.states[req.rid] for req in reqs],
                room=self.cache.allocator.available() - len(reqs))  # never evicts for drafts
            if drafts is not None:
                return self._make_verify_batch(reqs, drafts), reqs
        return self._make_batch(ForwardMode.DECODE, reqs, [1] * len(reqs)), reqs

    def _make_verify_batch(self, reqs: list[Req], drafts: list[list[int]]) -> Batch:
        """An EXTEND pass over each request's last token and its drafts (a request without
        drafts extends by its last token alone: a decode step)."""
        extend_lens = [1 + len(d) for d in drafts]
        out_cache_loc = self.cache.alloc(sum(extend_lens))
        prefix_lens = [req.kv_len for req in reqs]
        input_ids: list[int] = []
        for req, d in zip(reqs, drafts, strict=True):
            input_ids.append(req.output_ids[-1] if req.output_ids else req.origin_input_ids[-1])
            input_ids.extend(d)
        self.cache.extend_all(reqs, extend_lens, out_cache_loc)
        n = len(reqs)
        return Batch(mode=ForwardMode.EXTEND, rids=[req.rid for req in reqs],
                     req_pool_indices=[req.req_pool_idx for req in reqs],
                     prefix_lens=prefix_lens, extend_lens=extend_lens, input_ids=input_ids,
                     out_cache_loc=out_cache_loc, samples=[True] * n, input_logprobs=[None] * n,
                     mm_inputs=[None] * n, drafts=drafts)

    def _make_batch(self, mode: ForwardMode, reqs: list[Req], extend_lens: list[int], *,
                    follows_previous: bool = False,
                    previous_rows: list[int] | None = None) -> Batch:
        out_cache_loc = self.cache.alloc(sum(extend_lens))
        prefix_lens = [req.kv_len for req in reqs]
        pool_indices = [req.req_pool_idx for req in reqs]
        input_ids: list[int] = []
        samples: list[bool] = []
        spans: list[InputLogprobSpan | None] = []
        mm_inputs = [] if mode is ForwardMode.DECODE else [req.mm_inputs for req in reqs]
        shared: list[tuple[int, list[int]]] = []
        if mode is ForwardMode.DECODE:
            shared = self._shared_prefixes(reqs)
            self.cache.extend_each_by_one(reqs, out_cache_loc, pool_indices, prefix_lens)
            samples = [True] * len(reqs)
            if not follows_previous or (previous_rows and min(previous_rows) < 0):
                input_ids = [req.output_ids[-1] if req.output_ids else req.origin_input_ids[-1]
                             for req in reqs]
        else:
            for req, extend_len in zip(reqs, extend_lens, strict=True):
                input_ids.extend(req.fill_slice(req.kv_len, req.kv_len + extend_len))
            self.cache.extend_all(reqs, extend_lens, out_cache_loc)
            for req, extend_len in zip(reqs, extend_lens, strict=True):
                prefix_len = req.kv_len - extend_len
                completes = req.kv_len == req.fill_len
                samples.append(completes and samples_after_fill(req))
                spans.append(input_logprob_span(req, prefix_len, extend_len))
        return Batch(mode=mode, rids=[req.rid for req in reqs], req_pool_indices=pool_indices,
                     prefix_lens=prefix_lens, extend_lens=list(extend_lens), input_ids=input_ids,
                     out_cache_loc=out_cache_loc, samples=samples, input_logprobs=spans,
                     follows_previous=follows_previous, previous_rows=previous_rows,
                     mm_inputs=mm_inputs, shared_prefixes=shared)

    def _shared_prefixes(self, reqs: list[Req]) -> list[tuple[int, list[int]]]:
        """The decode batch's prefix groups, recomputed only when its requests change."""
        min_tokens = self.config.shared_prefix_min_tokens
        if not min_tokens or len(reqs) < 2:
            return []
        rids = [req.rid for req in reqs]
        if rids != self._shared_rids:
            self._shared_rids = rids
            self._shared = self.cache.cache.shared_prefixes(
                [req.cache_handle for req in reqs], min_tokens)
        return self._shared

    def _count_admission(self, req: Req) -> None:
        if not req.admitted:
            req.admitted = True
            req.cached_tokens = req.prefix_len
            self.stats.prompt_tokens += len(req.origin_input_ids)
            self.stats.cached_tokens += req.prefix_len
            self.stats.recent_hits.append((req.prefix_len, len(req.origin_input_ids)))
            media, cached_media = self.media.admitted(req)
            self.stats.media_tokens += media
            self.stats.cached_media_tokens += cached_media
            if req.prefix_len:
                self.cache.cache.note_hit(req.cache_handle)
        state = self.table.states[req.rid]
        if req.wants_input_logprobs and req.logprob_start_len == 0 and req.input_logprobs_done == 0:
            state.logprobs.input_token.append((None, req.origin_input_ids[0]))
            state.logprobs.input_top.append(None)
            state.logprobs.input_token_ids.append(None)
            req.input_logprobs_done = 1

    # ---- results ------------------------------------------------------------------------------
    def _process(self, batch: Batch, reqs: list[Req], output: StepOutput | VerifyOutput
                 ) -> None:
        for i, why in output.failed.items():  # nothing could be sampled: it alone ends
            logger.error("request %s: %s", reqs[i].rid, why)
            if (state := self.table.state_of(reqs[i])) is not None:
                self._finish(state, finish_abort(f"sampling failed: {why}"), cache_kv=False)
        if isinstance(output, VerifyOutput):
            self._process_verify(batch, reqs, output)
            return
        if batch.mode is not ForwardMode.EXTEND:
            self._process_decode(reqs, output)
            return
        seq_lens = batch.seq_lens
        for i, req in enumerate(reqs):
            state = self.table.state_of(req)
            if state is None:
                continue  # ended while its pass was in flight (overlap): the token is dropped
            req.forward_passes += 1
            filled = seq_lens[i] == req.fill_len  # else a chunk: it goes on (maybe in flight)
            if filled:
                self.table.prefilling.pop(req.rid, None)
            if output.input_logprobs[i]:
                state.logprobs.input_token.extend(output.input_logprobs[i])
                state.logprobs.input_top.extend(output.input_top_logprobs[i])
                state.logprobs.input_token_ids.extend(output.input_token_ids_logprobs[i])
                req.input_logprobs_done += len(output.input_logprobs[i])
            token = output.next_token_ids[i]
            if token is not None and req.sampling_params.max_new_tokens == 0:
                # Only the next token's top logprobs (or given ids' logprobs) were asked for:
                # the token is not output.
                if req.top_logprobs_num:
                    state.logprobs.output_top.append(output.next_top_logprobs[i] or [])
                if req.token_ids_logprob:
                    state.logprobs.output_token_ids.append(
                        output.next_token_ids_logprobs[i] or [])
                self._finish(state, finish_length(0))
            elif token is not None:
                req.status = ReqStatus.RUNNING
                self.table.running.append(req)
                self._append_token(state, token, output.next_token_logprobs[i],
                                   output.next_top_logprobs[i], output.next_token_ids_logprobs[i],
                                   admitted=True)
            elif filled:  # prompt done, nothing to generate
                self._finish(state, finish_length(len(req.output_ids)))

    def _process_verify(self, batch: Batch, reqs: list[Req], output: VerifyOutput) -> None:
        """A verify pass: each request keeps the KV of its last token and accepted drafts (the
        rejected drafts' slots go back at once) and appends its kept tokens one by one through
        every rule; ending (or jumping forward) mid-chain gives back the KV past that token, so
        the prefix cache only ever receives accepted tokens."""
        for i, req in enumerate(reqs):
            state = self.table.state_of(req)
            if state is None:
                continue
            req.forward_passes += 1
            drafted, tokens = len(batch.drafts[i]), output.tokens[i]
            accepted = len(tokens) - 1
            self.speculator.verified(req, drafted=drafted, accepted=accepted)
            held = self.cache.hold_tail(req, req.kv_len - drafted, keep=accepted)
            for m, token in enumerate(tokens):
                self._append_token(state, token, output.logprobs[i][m],
                                   output.top_logprobs[i][m], output.token_ids_logprobs[i][m],
                                   speculated=m < accepted)
                if req.req_pool_idx is None:  # ended or jumped at this token
                    self.cache.free_slots(held[m:])
                    break
                if m < accepted:
                    self.cache.regain(req)

    def _process_decode(self, reqs: list[Req], output: StepOutput) -> None:
        """`_process` of a DECODE pass (every request samples; no prompt logprobs), with the
        common case inline: a request without logprobs, grammar or text stop rules appends its
        token and checks the token and length rules only."""
        states, events, rules = self.table.states, self._events, self.stop_rules
        plain = 0
        for i, (req, token) in enumerate(zip(reqs, output.next_token_ids, strict=True)):
            state = states.get(req.rid)  # `RequestTable.state_of`, inline: once a request a step
            if state is None or state.req is not req:
                continue  # ended while its pass was in flight (overlap): the token is dropped
            req.forward_passes += 1
            if (token is None or req.return_logprob or state.grammar is not None
                    or state.stop_text is not None):
                if token is not None:
                    self._append_token(state, token, output.next_token_logprobs[i],
                                       output.next_top_logprobs[i],
                                       output.next_token_ids_logprobs[i])
                elif req.kv_len == req.fill_len:
                    self._finish(state, finish_length(len(req.output_ids)))
                continue
            output_ids = req.output_ids
            output_ids.append(token)
            plain += 1
            reason = rules.by_token_or_length(token, req.sampling_params, len(output_ids))
            if reason is None:
                events.append(TokenEvent(req.rid, [token]))
            else:
                self._finish(state, reason, new_ids=[token], cache_after_flush=True)
        self.stats.generated_tokens += plain

    def _append_token(self, state: ReqState, token: int, logprob: float | None,
                      top: list[tuple[float, int]] | None,
                      asked: list[tuple[float, int]] | None, *, speculated: bool = False,
                      admitted: bool = False) -> None:
        """Appends one output token through every rule (`asked`: the logprobs of the request's
        `token_ids_logprob` there); `speculated`: an accepted draft token of a verify pass (not
        sampled by this step); `admitted`: the first token since the request was (re)admitted
        (its event carries `admission_meta`)."""
        req, params = state.req, state.sampling_params
        req.output_ids.append(token)
        self.stats.generated_tokens += 1
        if not state.first_token_at:
            state.first_token_at = time.perf_counter()
            self.stats.first_tokens += 1
            self.stats.first_token_seconds += state.first_token_at - state.created_at
        if speculated:
            accept_speculated(state.origins, 1)
        elif state.origins is not None:
            state.origins.add(GENERATED)
        if req.return_logprob:
            state.logprobs.output_token.append((logprob, token))
            if req.top_logprobs_num:
                state.logprobs.output_top.append(top or [])
            if req.token_ids_logprob:
                state.logprobs.output_token_ids.append(asked or [])
        reason = self.stop_rules.by_token(token, params, len(req.output_ids))
        if reason is not None:
            self._finish(state, reason, new_ids=[token])
            return
        if state.grammar is not None:
            state.grammar.advance(token)
        if state.stop_text is not None:
            state.stop_text.add([token])
        reason = self.stop_rules.after_text(state.stop_text, state.grammar, params,
                                            len(req.output_ids))
        if reason is not None:
            self._finish(state, reason, new_ids=[token])
            return
        meta = live_meta(state, len(req.output_ids) - 1) if req.return_logprob else None
        if admitted:
            meta = {**(meta or {}), **admission_meta(state)}
        self._events.append(TokenEvent(req.rid, [token], meta=meta))
        if state.grammar is not None and self.jump_forward is not None:
            self._jump_forward(state)

    def _jump_forward(self, state: ReqState) -> None:
        """Compressed-FSM jump: text the constraint forces is appended at once. The output is
        re-tokenized as a whole; the request leaves the running batch (its KV goes to the prefix
        cache) and is prefilled again, reusing the KV of the unchanged prefix."""
        req = state.req
        forced = state.grammar.forced_text()
        if not forced:
            return
        plan = self.jump_forward.plan(req.text_prompt_ids, req.output_ids, forced)
        if plan is None or len(plan.new_output_ids) > req.sampling_params.max_new_tokens:
            return  # past max_new_tokens (which also keeps the context length): decode instead
        self.table.detach(req)
        self.cache.cache_finished(req)  # keyed by the old output ids
        new_ids = list(plan.new_output_ids)
        if state.stop_text is not None:  # a stop inside the jump: the output ends at its token
            state.stop_text, new_ids = self._stop_text_over(req, new_ids, plan.keep)
        appended = new_ids[plan.keep:]
        req.output_ids = new_ids
        if req.return_logprob:  # re-tokenized tokens were not sampled: they have no logprob
            logprobs = state.logprobs
            logprobs.output_token = (logprobs.output_token[:plan.keep]
                                     + [(None, token) for token in appended])
            if req.top_logprobs_num:
                logprobs.output_top = logprobs.output_top[:plan.keep] + [[] for _ in appended]
            if req.token_ids_logprob:
                logprobs.output_token_ids = (logprobs.output_token_ids[:plan.keep]
                                             + [[] for _ in appended])
        if state.origins is not None:
            # re-tokenized old text counts as generated; tokens of forced text only as jumped
            forced_from = min(plan.keep if plan.forced_from is None else plan.forced_from,
                              len(new_ids))
            state.origins.truncate(plan.keep)
            state.origins.add(GENERATED, forced_from - plan.keep)
            state.origins.add(JUMP_FORWARD, len(new_ids) - forced_from)
        state.grammar.advance_text(forced)
        req.jumps += 1
        self.stats.jump_forward_tokens += len(appended)
        state.jumped_tokens += len(appended)
        event = TokenEvent(req.rid, appended, replace_output_ids=list(new_ids),
                           meta=live_meta(state, plan.keep) if req.return_logprob else None)
        reason = self.stop_rules.after_text(state.stop_text, state.grammar, req.sampling_params,
                                            len(req.output_ids))
        if reason is not None:
            self._events.append(event)
            self._finish(state, reason)
        else:
            self._events.append(event)
            self.table.requeue_front(req)

    def _stop_text_over(self, req: Req, output_ids: list[int], keep: int
                        ) -> tuple[StopText, list[int]]:
        """The stop rules' text over a jump's new output ids (the first `keep` unchanged): each
        token after those is added in turn, and the ids end at the one completing a stop string
        or regex, as they would decoding one token at a time."""
        stop_text = StopText(self.tokenizer, req.text_prompt_ids, req.sampling_params)
        stop_text.add(output_ids[:keep])
        for end in range(keep, len(output_ids)):
            if stop_text.matched is not None:
                return stop_text, output_ids[:end]
            stop_text.add([output_ids[end]])
        return stop_text, output_ids

    def _finish(self, state: ReqState, reason: dict[str, Any], *, new_ids: list[int] | None = None,
                cache_kv: bool = True, cache_after_flush: bool = False) -> None:
        """Ends a request: its KV goes to the cache (or is freed) and the sink gets the end.
        `cache_after_flush`: the KV goes to the cache after the step's events are sent (the
        request is otherwise ended at once)."""
        req = state.req
        self.table.detach(req)
        if req.req_pool_idx is not None:
            if not cache_kv:
                self.cache.free(req)
            elif cache_after_flush and self.speculator is None:
                self._ended_kv.append(req)
            else:
                self.cache.cache_finished(req)
        req.finished_reason = reason
        req.status = ReqStatus.FINISHED
        if self.speculator is not None:
            self.speculator.finished(req, keep=cache_kv)
        self.table.remove(req)
        meta = request_meta(state, weight_version=self.config.weight_version)
        self._events.append(TokenEvent(req.rid, new_ids or [], reason, meta))

    def _hand_ended_kv_to_cache(self) -> None:
        while self._ended_kv:  # one at a time: a failure leaves the rest to `abort_all`
            self.cache.cache_finished(self._ended_kv.pop())

    def _flush(self) -> None:
        if self._events:
            events, self._events = self._events, []
            self.sink.put(events)

    # ---- accounting ---------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raises IntegrityError unless every KV slot and request row is accounted for."""
        self.cache.check_integrity(self.table.live(), self.table.waiting)
        if self.speculator is not None:
            self.speculator.check()

