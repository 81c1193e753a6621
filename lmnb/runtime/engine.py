"""`Runtime`: the in-process engine. Its scheduler runs on a daemon thread; any thread may call
`generate`, and a generate call blocks only its caller."""

from __future__ import annotations

import functools
import gc
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from itertools import accumulate
from pathlib import Path
from typing import Any

import torch

from lmnb.multimodal.items import MultimodalInputs
from lmnb.runtime import request_checks
from lmnb.runtime.builder import build_model, build_serving
from lmnb.runtime.chat import apply_chat_template
from lmnb.runtime.config import EngineConfig
from lmnb.runtime.core import Batch, InvalidRequestError, Req, SamplingParams, next_rid
from lmnb.runtime.distributed.events import CacheEventLog
from lmnb.runtime.distributed.group import TPError
from lmnb.runtime.fsm.protocol import Grammar
from lmnb.runtime.media_requests import MediaInput, build_media_prompts
from lmnb.runtime.output import OutputStream
from lmnb.runtime.output.token_origins import OutputOrigins
from lmnb.runtime.prompts import (
    FIRST_CHUNK,
    IdsInput,
    PromptInput,
    Prompts,
    encode_many,
    prompt_id_lists,
    split_prompts,
)
from lmnb.runtime.request_checks import (
    LogprobCountInput,
    LogprobFlagInput,
    LogprobOptions,
    SamplingInput,
    TokenIdsInput,
)
from lmnb.runtime.scheduler import ReqState
from lmnb.runtime.scheduler.held import HeldSubmissions
from lmnb.runtime.scheduler.profiler import ProfileOptions
from lmnb.runtime.surface import GenerateResult

_PIN_ATTEMPTS = 3


class Runtime:
    """A model plus a continuous-batching scheduler, living in this process.

    `Runtime()` loads the embedded SmolLM2-135M-Instruct; `Runtime(path)` a local HF folder or a
    GGUF file. Options follow SGLang's names. `close()` (or leaving a `with` block) frees memory;
    a new Runtime can be created afterwards in the same process.

    `tp_size=N` shards the model over N ranks: this process is rank 0 (scheduler, sampling) and
    starts N - 1 worker processes (`distributed/tp_worker.py`; CPU: gloo, CUDA: NCCL with rank r
    on cuda:r), which `close()` stops and which exit by themselves if this process dies.
    `lmnb.Runtime(path, dp_size=N)` (`launch.py`) is a `DataParallelRuntime` of N of these.
    """

    def __init__(self, model_path: str | Path | None = None, **options: Any) -> None:
        """`options` are `EngineConfig`'s fields (SGLang's names); an unknown one is a
        TypeError that lists the known ones, a bad value a ValueError."""
        config = EngineConfig.from_options(model_path=model_path, **options)
        if config.dp_size > 1:
            raise ValueError(f"dp_size={config.dp_size}: one engine serves one replica; "
                             f"lmnb.Runtime(..., dp_size={config.dp_size}) builds a "
                             f"DataParallelRuntime of {config.dp_size}")
        self.engine_config = config
        model = build_model(config)
        self.device, self.model_dir, self.dtype = model.device, model.model_dir, model.dtype
        self.model_config, self.tokenizer = model.model_config, model.tokenizer
        self.eos_token_ids = model.eos_token_ids
        self.media_processor = model.media_processor  # images/videos: None for a text model
        self._tp_workers, self._runner = model.tp_workers, model.runner
        self._fused_kernels = model.fused_kernels
        self.context_len = self._runner.context_len
        self.max_total_tokens = self._runner.max_total_tokens
        serving = build_serving(config, model)
        self._allocator, self._cache, self._pins = serving.allocator, serving.cache, serving.pins
        self._outputs, self._scheduler = serving.outputs, serving.scheduler
        self._grammars = serving.grammars
        self._held = HeldSubmissions(self._scheduler, self._outputs)
        self._tokenizer_lock = threading.Lock()
        self._cache_events: CacheEventLog | None = None
        self._closed = False
        # Like vLLM: the start-up heap (weights' wrappers, imports) leaves the collector's view, so
        # the full collections that pause every thread, the scheduler's too, scan only what came
        # later; `close` gives it back.
        gc.collect()
        gc.freeze()

    # ---- lifecycle -------------------------------------------------------------------------
    def close(self) -> None:
        """Stops the scheduler (aborting what is in flight) and frees the model and KV memory."""
        if self._closed:
            return
        self._closed = True
        profiler = self._scheduler.scheduler.profiler
        if profiler.active and self._scheduler.fatal_error is None:
            self._scheduler.call(profiler.stop)  # its trace written, torch's profiler freed
        self._scheduler.stop()
        self._outputs.close()
        if (speculator := self._scheduler.scheduler.speculator) is not None:
            speculator.close()  # a draft model's runner
        self._cache.close()  # a tiered cache writes its queued disk pages first
        if self._tp_workers is not None:
            self._runner.release_graphs()  # graphs that captured collectives go first
            self._tp_workers.close()
        self._runner.close()
        gc.unfreeze()
        gc.collect()  # the closed engine's cycles, and their device memory
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Runtime is closed; create a new one")
        if self._scheduler.fatal_error is not None:
            raise RuntimeError("the scheduler failed") from self._scheduler.fatal_error
        if self._tp_workers is not None:
            self._runner.tp.check()  # a worker died, or a step failed midway: TPError

    # ---- introspection -----------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raises `IntegrityError` unless every KV slot and request slot is accounted for."""
        self._check_open()
        self._scheduler.call(self._scheduler.scheduler.check_integrity)

    def stats(self) -> dict[str, Any]:
        """Counters and gauges: hit rate (cumulative and over the recent window), forward passes,
        retractions, evictions, radix tree size, KV pool usage, pins, attention backend, decode
        graphs, memory; each collaborator reports its own part (read between steps)."""
        self._check_open()
        scheduler = self._scheduler.scheduler

        def read() -> dict[str, Any]:
            return {**scheduler.report(), **self._runner.stats(), **self._cache.stats(),
                    **self._allocator.stats(), **self._pins.stats(),
                    "tp_size": self.engine_config.tp_size,
                    "fused_kernels": self._fused_kernels}

        return self._scheduler.call(read)

    def cache_events(self, since: int = 0) -> dict[str, Any]:
        """Prefix-cache evictions numbered after `since` (see `CacheEventLog.since`) and the
        tokens cached now (`cached_tokens`), for a data-parallel router's meta tree. Recording
        starts with the first call."""
        self._check_open()
        cache = self._cache

        def read() -> dict[str, Any]:  # on the scheduler thread: between steps
            if self._cache_events is None:
                self._cache_events = CacheEventLog()
                cache.eviction_listener = self._cache_events  # a cache that evicts tells it
            report = self._cache_events.since(since)
            report["cached_tokens"] = cache.evictable_size() + cache.protected_size()
            return report

        return self._scheduler.call(read)

    def set_batch_hook(self, hook: Callable[[Batch], None] | None) -> None:
        """Calls `hook(batch)` on the scheduler thread after every forward pass with the `Batch`
        that ran (plain data: mode, prefix/extend lengths, samples), e.g. to compute the floor of
        the schedule in benchmarks; None removes it. The hook must be quick and not keep the
        batch's tensors."""
        self._check_open()
        scheduler = self._scheduler.scheduler

        def install() -> None:
            scheduler.batch_hook = hook

        self._scheduler.call(install)

    def flush_cache(self) -> bool:
        """Empties the prefix cache, except pinned prefixes (`pin_prefix`); refused (returns
        False) while requests are in flight."""
        self._check_open()
        scheduler, cache = self._scheduler.scheduler, self._cache

        def flush() -> bool:
            if scheduler.has_work:
                return False
            cache.drop_unlocked()  # host copies too: a pin must not keep a flushed prompt
            if scheduler.speculator is not None:
                scheduler.speculator.reset()  # recent requests' n-grams
            if not self._pins:  # a pinned path stays; without pins the tree starts afresh
                cache.reset()
            return True

        return self._scheduler.call(flush)

    def start_profile(self, output_dir: str | None = None, *, num_steps: int | None = None,
                      activities: Sequence[str] | None = None, with_stack: bool | None = None,
                      record_shapes: bool | None = None) -> Path:
        """SGLang's `Engine.start_profile`: a torch profiler over the forward passes from now
        until `stop_profile` (or `num_steps` passes). Returns the directory the Chrome trace goes
        to (`output_dir`, default a new temporary one). Defaults are `ProfileOptions`'; one
        profile at a time (InvalidRequestError)."""
        self._check_open()
        options = ProfileOptions(output_dir=output_dir, num_steps=num_steps,
                                 activities=None if activities is None else tuple(activities),
                                 with_stack=with_stack, record_shapes=record_shapes)
        profiler = self._scheduler.scheduler.profiler
        return self._scheduler.call(lambda: profiler.start(options, device=self.device))

    def stop_profile(self) -> Path:
        """Stops the profile `start_profile` began and writes its trace; returns the trace's
        path. InvalidRequestError when none runs (never started, or `num_steps` ended it)."""
        self._check_open()
        return self._scheduler.call(self._scheduler.scheduler.profiler.stop)

    def cache_snapshot(self, preview_tokens: int = 16) -> list[dict[str, Any]]:
        """The radix tree as plain data (node id, parent, token count, text preview, lock_ref,
        last access, hit count, tier: where its KV lives, 'device', 'host' or 'device+host'),
        parents first; empty without a radix cache."""
        self._check_open()
        if not self._cache.reuses_kv:
            return []
        media = self._scheduler.scheduler.media
        rows, pads = self._scheduler.call(
            lambda: (self._cache.snapshot(preview_tokens), media.pad_kinds()))
        for row in rows:
            ids = row.pop("key_preview")
            row["text"] = self._preview_text(ids, pads)
        return rows

    def _preview_text(self, ids: list[int], pads: dict[int, tuple[str, int]]) -> str:
        """Token ids as text, each run of a media span's pad ids shown as `[image 1a2b3c4d]`."""
        vocab = self.model_config.vocab_size
        if all(t < vocab for t in ids):
            return self.tokenizer.decode(ids, skip_special_tokens=False)
        parts: list[str] = []
        run: list[int] = []
        previous = None
        for token in ids:
            if token < vocab:
                run.append(token)
                previous = None
                continue
            if run:
                parts.append(self.tokenizer.decode(run, skip_special_tokens=False))
                run = []
            if token != previous:
                kind, media_hash = pads.get(token, ("media", token - vocab))
                parts.append(f"[{kind} {media_hash:016x}"[:len(kind) + 10] + "]")  # 8 hex digits
            previous = token
        if run:
            parts.append(self.tokenizer.decode(run, skip_special_tokens=False))
        return "".join(parts)

    def media_snapshot(self) -> list[dict[str, Any]]:
        """The media this runtime has seen, most recent first (at most 64): per content hash
        `{"hash": hex str, "kind": "image"|"video", "num_tokens", "requests", "hits" (requests
        that found its whole span cached), "resident" (its span is in the prefix cache now),
        "thumbnail" (PNG bytes or None), "size": (h, w)}`. Empty for a text model."""
        self._check_open()
        scheduler = self._scheduler.scheduler
        return self._scheduler.call(lambda: scheduler.media.snapshot(self._cache))

    def cache_prefix(self, prompt: str | None = None, *,
                     input_ids: Sequence[int] | None = None, image_data: MediaInput = None,
                     video_data: MediaInput = None) -> int:
        """Prefills `prompt` (or `input_ids`, with its media) into the cache without
        generating; returns the number of tokens it holds (media spans included). The
        frontend's hint for forks and batches."""
        out = self.generate(prompt, {"max_new_tokens": 0}, input_ids=input_ids,
                            image_data=image_data, video_data=video_data)
        if isinstance(out, list):
            raise InvalidRequestError("cache_prefix takes one prompt")
        return out["meta_info"]["prompt_tokens"]

    def pin_prefix(self, prompt: str | None = None, *,
                   input_ids: Sequence[int] | None = None) -> int:
        """Caches `prompt` (or `input_ids`) like `cache_prefix` and keeps it cached until
        `unpin_prefix(pin)`: eviction skips it, however full the KV pool gets (its slots count as
        protected, as a running request's prefix). Returns the pin id. Pinning the same prefix
        twice holds two pins. Needs the radix cache."""
        self._check_open()
        if not self._cache.reuses_kv:
            raise InvalidRequestError("pin_prefix needs the prefix cache (disable_radix_cache "
                                      "is set)")
        token_lists, is_batch = prompt_id_lists(prompt, input_ids, self.encode)
        if is_batch:
            raise InvalidRequestError("pin_prefix takes one prompt")
        ids = token_lists[0]
        for _ in range(_PIN_ATTEMPTS):  # other requests may evict it before the lock is taken
            self.cache_prefix(input_ids=ids)
            pin_id = self._scheduler.call(lambda: self._pins.pin(ids))
            if pin_id is not None:
                return pin_id
        raise InvalidRequestError(f"could not pin {len(ids)} tokens: other requests evicted "
                                  f"them as soon as they were cached (the KV pool is too full)")

    def unpin_prefix(self, pin_id: int) -> bool:
        """Releases a pin of `pin_prefix`: its tokens stay cached but become evictable. False if
        no such pin is held."""
        self._check_open()
        return self._scheduler.call(lambda: self._pins.unpin(pin_id))

    # ---- generation --------------------------------------------------------------------------
    def generate(
        self,
        prompt: PromptInput = None,
        sampling_params: SamplingInput = None,
        *,
        input_ids: IdsInput = None,
        image_data: MediaInput = None,
        video_data: MediaInput = None,
        return_logprob: LogprobFlagInput = False,
        logprob_start_len: LogprobCountInput = None,
        top_logprobs_num: LogprobCountInput = None,
        token_ids_logprob: TokenIdsInput = None,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        return_token_origins: bool = False,
        incremental: bool = True,
    ) -> GenerateResult:
        """Generates for one prompt (returns a dict) or a list (returns a list of dicts; with
        `n > 1`, `n` consecutive dicts per prompt). With `stream=True`, an `OutputStream` of
        incremental dicts (`text` and `output_ids` are what is new; the last one per request has
        `meta_info["finish_reason"]`), consumed by a thread (`for`, `get(timeout)`) or an asyncio
        task (`async for`); leaving the loop early or `close()` aborts the requests. With
        `stream=True, incremental=False` the stream holds one whole dict per request, at its end
        (what `stream=False` returns, awaitable without a wake-up per token).

        With `return_logprob`, `meta_info` lists `(logprob, token_id)` pairs, or SGLang's
        `(logprob, token_id, text)` triples with `return_text_in_logprobs`; with
        `max_new_tokens` 0 and `top_logprobs_num` k, `output_top_logprobs` has one row: the top k
        of the token that would come next (SGLang's). `token_ids_logprob` (SGLang's; ids for
        every prompt, or a list per prompt) adds the logprobs of those ids, in that order, at
        every output position (`output_token_ids_logprobs`) and, with `logprob_start_len`, every
        prompt position (`input_token_ids_logprobs`), rows like `output_top_logprobs`'; with
        `max_new_tokens` 0 one output row, for the token that would come next (SGLang's scoring).
        For a list of prompts, `return_logprob`, `logprob_start_len` and `top_logprobs_num` may
        each be a list too, one value per prompt (SGLang's). Streamed, a running chunk carries
        its new tokens' rows (`new_token_logprobs`, `new_top_logprobs`,
        `new_token_ids_logprobs`, from output position `output_ids_from`).
        The first streamed chunk after each admission carries `cached_tokens` and
        `total_retractions` (and with `return_logprob` the prompt's lists).

        `return_token_origins` (implies `return_logprob`) adds where each token came from:
        `prompt_token_origins` and `output_token_origins` spans (cached / computed prompt,
        generated / jump_forward / speculated output; `lmnb.runtime.output.token_origins`), also
        in each streamed chunk with that chunk's logprobs.

        Multimodal models (SGLang's engine arguments): `image_data` is, for one prompt, an image
        or a list of images in the order of the prompt's image tokens (a path, `PIL.Image`,
        uint8 array, bytes, `data:` URL or a `MediaItem`); for a list of prompts, a list of
        those (None for a prompt without images) or one image for every prompt. `video_data`
        likewise with videos (a path, bytes, `data:` URL, uint8 frames [F, H, W, 3], a
        `MediaItem`, or `{"video": source, "num_frames": n}`; 8 frames by default). Each
        image/video token of the prompt becomes the item's span of tokens; bad media or a count
        mismatch is an `InvalidRequestError`."""
        self._check_open()
        prompts = split_prompts(prompt, input_ids)
        params_list = request_checks.params_list(sampling_params, len(prompts))
        logprobs, token_ids = request_checks.logprob_requests(
            return_logprob, logprob_start_len, top_logprobs_num, token_ids_logprob,
            count=len(prompts), is_batch=prompts.is_batch,
            vocab_size=self.model_config.vocab_size, always=return_token_origins)
        return self._start(prompts, params_list, image_data=image_data, video_data=video_data,
                           logprobs=logprobs, token_ids=token_ids,
                           return_text_in_logprobs=return_text_in_logprobs, stream=stream,
                           return_token_origins=return_token_origins, incremental=incremental,
                           ids_trusted=prompts.encoded and self._tokenizer_ids_fit)

    def submit_encoded(self, ids: list[int], params: SamplingParams, *,
                       return_logprob: bool = False, logprob_start_len: int | None = None,
                       top_logprobs_num: int | None = None, return_token_origins: bool = False,
                       incremental: bool = True) -> OutputStream:
        """`generate(input_ids=ids, stream=True)` of one prompt whose `ids` this runtime's
        tokenizer made (`encode`'s: no range check when every tokenizer id fits the vocabulary)
        and whose `params` are already parsed (shared, never mutated; checked against the context
        as `generate`'s). `ids` is kept as given (the caller must not change it). The DSL's
        local backend submits this way: the public `generate` parses and checks everything."""
        self._check_open()
        return_logprob = return_logprob or return_token_origins
        logprob_start, top_logprobs = request_checks.logprob_options(
            return_logprob, logprob_start_len, top_logprobs_num,
            vocab_size=self.model_config.vocab_size)
        output = self._start(Prompts(None, [ids], False), [params], image_data=None,
                             video_data=None,
                             logprobs=[LogprobOptions(return_logprob, logprob_start,
                                                      top_logprobs)],
                             token_ids=[None], return_text_in_logprobs=False, stream=True,
                             return_token_origins=return_token_origins,
                             incremental=incremental, ids_trusted=self._tokenizer_ids_fit)
        assert isinstance(output, OutputStream)
        return output

    def _start(self, prompts: Prompts, params_list: list[SamplingParams], *,
               image_data: MediaInput, video_data: MediaInput, logprobs: list[LogprobOptions],
               token_ids: list[list[int] | None],
               return_text_in_logprobs: bool,
               stream: bool, return_token_origins: bool, incremental: bool,
               ids_trusted: bool) -> GenerateResult:
        """`generate` of prompts, parameters and logprob options (one each per prompt) that
        passed its shape checks: each prompt is checked (`request_checks.check_prompt`), its
        requests registered and submitted."""
        first_state = list(accumulate((params.n for params in params_list), initial=0))
        rids = [next_rid() for _ in range(first_state[-1])]  # announced before any submit
        single = not prompts.is_batch and len(rids) == 1
        output = OutputStream(rids, incremental=stream and incremental,
                              tagged=stream and not single, on_close=self._abort_rids,
                              poll=self._check_open)
        media = image_data is not None or video_data is not None
        try:
            # Texts: the first chunk is encoded and submitted at once (the scheduler starts
            # prefilling it) while later, larger chunks are encoded; ids and media: one chunk.
            for start, token_lists in prompts.chunks(
                    self._encode_many, first=len(prompts) if media else FIRST_CHUNK):
                chunk = build_media_prompts(
                    self.media_processor, token_lists, image_data, video_data,
                    is_batch=prompts.is_batch, vocab_size=self.model_config.vocab_size,
                    model_name=self.model_config.architecture or "this model")
                states: list[ReqState] = []
                for index, (ids, mm) in enumerate(chunk, start):
                    options = logprobs[index]
                    params = request_checks.check_prompt(
                        ids, params_list[index], context_len=self.context_len,
                        vocab_size=self.model_config.vocab_size, logprob_start=options.start,
                        mm_inputs=mm, ids_trusted=ids_trusted,
                        allow_auto_truncate=self.engine_config.allow_auto_truncate)
                    states.extend(
                        self._make_state(ids, params, rid=rids[first_state[index] + k],
                                         sample_index=k, logprobs=options,
                                         token_ids_logprob=token_ids[index], mm_inputs=mm,
                                         token_origins=return_token_origins)
                        for k in range(params.n))
                registrations = [self._outputs.registration(
                    output, state.rid, tokenizer=self.tokenizer,
                    prompt_ids=state.origin_input_ids,  # pads decode ''
                    skip_special_tokens=state.sampling_params.skip_special_tokens,
                    stop=state.sampling_params.stop, stop_regex=state.sampling_params.stop_regex,
                    token_texts=state.req.return_logprob and return_text_in_logprobs)
                    for state in states]
                if stream:
                    self._held.submit(output, states, registrations)
                else:  # its caller waits for it here: never held
                    self._outputs.register_many(registrations)
                    self._scheduler.submit_many(states)
        except BaseException:  # a bad prompt in a later chunk, Ctrl-C: abort what was submitted
            output.close()
            raise
        if stream:
            return output
        with output:  # an interrupt (Ctrl-C) closes it, which aborts the requests
            results = output.results()
        return results[0] if single else results

    @contextmanager
    def batched_submits(self) -> Iterator[None]:
        """The requests of every `generate(stream=True)` this thread makes inside the block
        reach the scheduler together when the (outermost) block ends, in one message: its next
        pass is planned with all of them, as for one `generate` of a list. Blocking `generate`
        calls are sent at once. The DSL's program loop holds the gens of one loop iteration."""
        with self._held.hold():
            yield

    def _abort_rids(self, rids: list[int]) -> None:
        if not self._closed:
            for rid in rids:
                self._scheduler.abort(rid, "interrupted")

    # ---- request building ----------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as `generate` would feed them (special tokens added)."""
        with self._tokenizer_lock:
            return self.tokenizer.encode(text, add_special_tokens=True)

    def _encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` of each text, in one batch call of a fast tokenizer."""
        with self._tokenizer_lock:
            return encode_many(self.tokenizer, texts)

    @functools.cached_property
    def _tokenizer_ids_fit(self) -> bool:
        """Every id the tokenizer can produce is below the model's vocab_size (then its
        encodings need no range check)."""
        with self._tokenizer_lock:
            vocab = self.tokenizer.get_vocab()
        return max(vocab.values(), default=0) < self.model_config.vocab_size

    def _make_state(self, ids: list[int], params: SamplingParams, *, rid: int,
                    sample_index: int, logprobs: LogprobOptions,
                    token_ids_logprob: list[int] | None = None,
                    mm_inputs: MultimodalInputs | None = None,
                    token_origins: bool = False) -> ReqState:
        """The request of a prompt that passed `request_checks.check_prompt` (with the params it
        returned)."""
        req = Req(origin_input_ids=ids, sampling_params=params,
                  return_logprob=logprobs.return_logprob, logprob_start_len=logprobs.start,
                  top_logprobs_num=logprobs.top,
                  token_ids_logprob=token_ids_logprob, rid=rid, sample_index=sample_index,
                  mm_inputs=mm_inputs)
        state = ReqState(req, created_at=time.perf_counter(),
                         origins=OutputOrigins() if token_origins else None)
        state.grammar = self._grammar(params)
        if params.seed is not None:
            state.generator = torch.Generator(device=self.device).manual_seed(
                params.seed + sample_index)
        return state

    # ---- media ---------------------------------------------------------------------------------
    @property
    def image_token(self) -> str | None:
        """The text of the prompt token that stands for one image (None: no images)."""
        return self._token_text(None if self.media_processor is None
                                else self.media_processor.image_token_id)

    @property
    def video_token(self) -> str | None:
        """The text of the prompt token that stands for one video (None: no videos)."""
        return self._token_text(None if self.media_processor is None
                                else self.media_processor.video_token_id)

    def _token_text(self, token_id: int | None) -> str | None:
        if token_id is None:
            return None
        with self._tokenizer_lock:
            return self.tokenizer.convert_ids_to_tokens(token_id)

    def _grammar(self, params: SamplingParams) -> Grammar | None:
        """The request's regex / JSON-schema / EBNF constraint (None without one), through
        `grammar_backend`; InvalidRequestError names a bad one."""
        return self._grammars.make(params)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's weights (what one decode step at least reads)."""
        return self._runner.weight_bytes

    # ---- seams for the frontends -----------------------------------------------------------------
    @property
    def failed(self) -> bool:
        """The scheduler stopped on an error (or a tensor-parallel worker died); every later call
        raises it (create a new Runtime)."""
        if self._tp_workers is not None and not self._closed:
            try:
                self._runner.tp.check()
            except TPError:
                return True
        return self._scheduler.fatal_error is not None

    def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                            add_generation_prompt: bool = True, *,
                            tools: list[dict[str, Any]] | None = None,
                            template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The prompt text of chat `messages` in the model's own template, ready for
        `generate` (see `lmnb.runtime.chat.apply_chat_template`)."""
        with self._tokenizer_lock:
            return apply_chat_template(self.tokenizer, messages,
                                       add_generation_prompt=add_generation_prompt, tools=tools,
                                       template_kwargs=template_kwargs)

    # ---- SGLang's names ----------------------------------------------------------------------
    def shutdown(self) -> None:
        """SGLang's `Runtime.shutdown()`: the same as `close()` (idempotent)."""
        self.close()

    def get_tokenizer(self) -> Any:
        """SGLang's `Runtime.get_tokenizer()`: the model's HF tokenizer (`tokenizer`)."""
        return self.tokenizer
