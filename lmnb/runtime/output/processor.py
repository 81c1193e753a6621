"""`OutputProcessor`: the output thread. It turns the scheduler's per-step `TokenEvent` batches
into text deltas (one `IncrementalDetokenizer` per request) and delivers chunks to streams."""

from __future__ import annotations

import queue
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lmnb.runtime.output.detokenizer import PROMPT_TAIL, Decoder, IncrementalDetokenizer
from lmnb.runtime.output.events import TokenEvent
from lmnb.runtime.output.logprob_text import TokenTexts, with_token_texts
from lmnb.runtime.output.loop_waker import held_wakes
from lmnb.runtime.output.stop import (
    compile_stop_regex,
    first_stop_regex_match,
    stopped_on_token,
)
from lmnb.runtime.output.stream import Chunk, OutputStream


@dataclass(slots=True)
class Registration:
    """One request announced to the output thread (`OutputProcessor.registration`)."""

    rid: Any
    stream: OutputStream
    tokenizer: Decoder
    prompt_tail: list[int]  # the prompt's last ids (the output is decoded after them)
    prompt_tokens: int
    skip_special_tokens: bool
    stop: tuple[str, ...]
    stop_regex: tuple[str, ...]
    created_at: float
    token_texts: bool


@dataclass(frozen=True, slots=True)
class _Registrations:
    """One inbox message of `register_many`."""

    items: list[Registration]


@dataclass(slots=True)
class _RequestOutput:
    """Per-request state, touched only by the output thread."""

    stream: OutputStream
    detokenizer: IncrementalDetokenizer
    id: str  # meta_info["id"]
    prompt_tail: list[int]
    prompt_tokens: int
    created_at: float
    output_ids: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)  # text delivered (or, whole, to deliver)
    skip: int = 0  # characters of the detokenizer's coming text that were already delivered
    stop_regex: list[re.Pattern] = field(default_factory=list)
    token_texts: TokenTexts | None = None  # logprobs as (logprob, id, text) triples


class OutputProcessor:
    """One per Runtime. `register` a request (from the caller's thread, before submitting it to
    the scheduler), then the scheduler `put`s one list of `TokenEvent`s per step. Events of
    unregistered requests are ignored. `start()` runs the loop on a daemon thread; tests may call
    `pump()` instead."""

    def __init__(self, *, name: str = "lmnb-output") -> None:
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._requests: dict[Any, _RequestOutput] = {}
        self._token_texts: dict[int, TokenTexts] = {}  # per tokenizer (by id), for logprob texts
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._closed = False
        self.busy_seconds = 0.0  # CPU time of this thread in `process` (for benchmarks)
        self.batches_handled = 0

    # ---- called from other threads ---------------------------------------------------------------
    def register(self, stream: OutputStream, rid: Any, *, tokenizer: Decoder,
                 prompt_ids: Sequence[int], skip_special_tokens: bool = True,
                 stop: Sequence[str] = (), stop_regex: Sequence[str] = (),
                 token_texts: bool = False) -> None:
        """Announces request `rid` (one of `stream.rids`); call before the scheduler may emit for
        it: registrations and events share one FIFO. `token_texts`: logprobs in `meta_info` as
        `(logprob, id, text)` triples (SGLang's `return_text_in_logprobs`)."""
        self.register_many([self.registration(
            stream, rid, tokenizer=tokenizer, prompt_ids=prompt_ids,
            skip_special_tokens=skip_special_tokens, stop=stop, stop_regex=stop_regex,
            token_texts=token_texts)])

    @staticmethod
    def registration(stream: OutputStream, rid: Any, *, tokenizer: Decoder,
                     prompt_ids: Sequence[int], skip_special_tokens: bool = True,
                     stop: Sequence[str] = (), stop_regex: Sequence[str] = (),
                     token_texts: bool = False) -> Registration:
        """`register`'s announcement, made now (its `created_at`) and sent later by
        `register_many` (with others: one message, one wake-up of the output thread)."""
        if rid not in stream.index:
            raise ValueError(f"request {rid!r} is not one of the stream's {stream.rids}")
        return Registration(rid, stream, tokenizer, list(prompt_ids[-PROMPT_TAIL:]),
                            len(prompt_ids), skip_special_tokens,
                            tuple(stop), tuple(stop_regex), time.perf_counter(), token_texts)

    def register_many(self, registrations: Sequence[Registration]) -> None:
        """`register` of several requests in one inbox message; after `close`, their streams
        fail at once (nobody would deliver to them)."""
        if not registrations:
            return
        if self._closed:
            for item in registrations:
                item.stream.fail(RuntimeError("the runtime was closed"))
            return
        self._inbox.put(_Registrations(list(registrations)))

    def put(self, events: list[TokenEvent]) -> None:
        """The scheduler's one call per step (cheap: a queue put)."""
        if events:
            self._inbox.put(events)

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float | None = None) -> None:
        """Handles what was put so far, stops the thread, and fails streams still waiting."""
        if self._closed:
            return
        self._closed = True
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)
        else:
            self.pump()
        for state in self._requests.values():
            state.stream.fail(RuntimeError("the runtime was closed"))
        self._requests.clear()

    # ---- the output thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        while self._handle(self._inbox.get()):
            pass

    def pump(self) -> int:
        """Handles everything queued now, on the calling thread; returns how many items."""
        count = 0
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return count
            count += 1
            if not self._handle(item):
                return count

    def _handle(self, item: Any) -> bool:
        if item is None:
            return False
        if isinstance(item, _Registrations):
            for registration in item.items:
                try:
                    self._requests[registration.rid] = self._request_output(registration)
                except Exception as error:  # its tokenizer failed on the prompt: its stream only
                    registration.stream.fail(error)
        else:
            start = time.thread_time()
            self.process(item)
            self.busy_seconds += time.thread_time() - start
            self.batches_handled += 1
        return True

    def _request_output(self, item: Registration) -> _RequestOutput:
        return _RequestOutput(
            stream=item.stream, id=str(item.rid), prompt_tail=item.prompt_tail,
            prompt_tokens=item.prompt_tokens, created_at=item.created_at,
            stop_regex=compile_stop_regex(item.stop_regex),
            token_texts=self._texts_of(item.tokenizer) if item.token_texts else None,
            detokenizer=IncrementalDetokenizer(
                item.tokenizer, item.prompt_tail,
                skip_special_tokens=item.skip_special_tokens, stop=item.stop))

    def process(self, events: list[TokenEvent]) -> None:
        """One scheduler step: each stream gets one delivery with its requests' chunks; the
        asyncio consumers' loops are woken once, after the step's last delivery."""
        with held_wakes():
            self._process(events)

    def _process(self, events: list[TokenEvent]) -> None:
        out: dict[OutputStream, list[Chunk]] = {}
        for event in events:
            state = self._requests.get(event.rid)
            if state is None:
                continue
            try:
                chunk = self._apply(event, state)
            except Exception as error:  # a tokenizer failure ends this request's stream only
                self._requests.pop(event.rid, None)
                state.stream.fail(error)
                continue
            if chunk is not None:
                out.setdefault(state.stream, []).append(chunk)
        for stream, chunks in out.items():
            stream.deliver(chunks)

    def _apply(self, event: TokenEvent, state: _RequestOutput) -> Chunk | None:
        reason = event.finished_reason
        if event.replace_output_ids is not None:
            state.output_ids = list(event.replace_output_ids)
            delta = self._replace(state)
        else:
            ids = event.new_token_ids
            state.output_ids.extend(ids)
            delta = state.detokenizer.add(
                ids[:-1] if reason is not None and stopped_on_token(reason, ids) else ids)
        if reason is not None:
            delta += state.detokenizer.finish()
            del self._requests[event.rid]
        if state.skip:
            taken = min(state.skip, len(delta))
            state.skip -= taken
            delta = delta[taken:]
        if reason is not None and state.stop_regex and reason.get("type") == "stop":
            delta = self._cut_at_stop_regex(state, delta)
        if delta:
            state.pieces.append(delta)
        stream = state.stream
        incremental = stream.incremental
        if reason is None and not incremental:
            return None
        meta: dict[str, Any] = {"id": state.id, "prompt_tokens": state.prompt_tokens,
                                "finish_reason": reason,
                                "completion_tokens": len(state.output_ids)}
        if reason is not None:
            meta["e2e_latency"] = time.perf_counter() - state.created_at
        if incremental and event.replace_output_ids is not None:
            # a jump-forward re-tokenized the tail: the chunk's ids go from here on (the
            # position token origins' live meta gives too)
            meta["output_ids_from"] = len(event.replace_output_ids) - len(event.new_token_ids)
        if event.meta:
            meta.update(event.meta if state.token_texts is None
                        else with_token_texts(event.meta, state.token_texts))
        if incremental:
            chunk = {"text": delta, "output_ids": list(event.new_token_ids), "meta_info": meta}
        else:
            chunk = {"text": "".join(state.pieces), "output_ids": list(state.output_ids),
                     "meta_info": meta}
        if stream.tagged:
            chunk["index"] = stream.index[event.rid]
        return chunk

    def _texts_of(self, tokenizer: Decoder) -> TokenTexts:
        texts = self._token_texts.get(id(tokenizer))
        if texts is None:
            texts = self._token_texts[id(tokenizer)] = TokenTexts(tokenizer)
        return texts

    @staticmethod
    def _cut_at_stop_regex(state: _RequestOutput, delta: str) -> str:
        """The text ends where the scheduler's stop regex matched (the same rule on the same
        text); text already streamed before the match completed stays streamed."""
        delivered = "".join(state.pieces)
        match = first_stop_regex_match(state.stop_regex, delivered + delta)
        if match is None:
            return delta
        if not state.stream.incremental:
            state.pieces = [delivered[:match.start()]]
        return delta[:max(match.start() - len(delivered), 0)]

    @staticmethod
    def _replace(state: _RequestOutput) -> str:
        """The output was re-tokenized: a new detokenizer reads it whole. Text already delivered
        cannot be taken back; what the new one adds past it is the delta."""
        old = state.detokenizer
        delivered = "".join(state.pieces)
        state.detokenizer = IncrementalDetokenizer(
            old.tokenizer, state.prompt_tail, skip_special_tokens=old.skip_special_tokens,
            stop=old.stop)
        text = state.detokenizer.add(state.output_ids)
        state.skip = max(len(delivered) - len(text), 0)
        return text[len(delivered):]
