"""`DataParallelRuntime`: N replicas of a model behind one cache-aware `Router`, with the surface
of `Runtime` that the DSL, the server and the widgets use (`generate` incl. streaming, `encode`,
`apply_chat_template`, `cache_prefix`, `flush_cache`, `stats`, `close`). `Runtime(path,
dp_size=N)` builds one.

    caller thread ── generate ──> tokenize, Router.route (meta tree + loads), one OutputStream
                                   │  per replica: one batched request (its prompts, in order)
    router loop thread (asyncio) ──┴─> Replica.generate ──> chunks re-tagged into the stream
                                   └─> every `event_poll_interval` s: replicas' evictions -> tree

Replicas are local processes (`replica_backend="process"`: `python -m lmnb serve` children over
loopback HTTP, one GPU each when there are GPUs) or Ray actors (`"ray"`, any node of the cluster
`ray_address` names). A replica that dies fails the requests it was serving with
`ReplicaDiedError`; the router stops sending it work and serves on the others.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import os
import threading
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lmnb.multimodal.processor import MediaProcessor
from lmnb.params import InvalidRequestError
from lmnb.runtime import request_checks
from lmnb.runtime.chat import apply_chat_template
from lmnb.runtime.config import EngineConfig
from lmnb.runtime.distributed.replica import (
    ProcessReplica,
    Replica,
    ReplicaDiedError,
    output_names,
)
from lmnb.runtime.distributed.router import Router, RouterConfig
from lmnb.runtime.media_requests import MediaInput
from lmnb.runtime.models import loader
from lmnb.runtime.output import OutputStream
from lmnb.runtime.output.logprob_lists import PROMPT_LISTS, asked_start
from lmnb.runtime.output.logprob_text import TokenTexts, with_token_texts
from lmnb.runtime.prompts import IdsInput, PromptInput, prompt_id_lists
from lmnb.runtime.request_checks import (
    LogprobCountInput,
    LogprobFlagInput,
    SamplingInput,
    TokenIdsInput,
)
from lmnb.runtime.surface import GenerateResult

REPLICA_BACKENDS = ("process", "ray")

# Counters summed over replicas in `stats()`; rates are recomputed from the sums.
_SUMMED = ("forward_passes", "retractions", "prompt_tokens", "cached_tokens", "generated_tokens",
           "jump_forward_tokens", "evicted_tokens", "eviction_events", "tree_nodes",
           "tree_tokens", "evictable_tokens", "protected_tokens", "max_total_tokens",
           "free_tokens", "running", "waiting")


class _LoopThread:
    """An asyncio event loop on a daemon thread; coroutines are handed to it from any thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, daemon=True, name="lmnb-dp-router")
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def spawn(self, coro: Coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine, timeout: float | None = None) -> Any:
        return self.spawn(coro).result(timeout)

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10.0)
        if not self.thread.is_alive():
            self.loop.close()


class DataParallelRuntime:
    """`dp_size` replicas of one model behind a cache-aware router (see the module docstring).

    `options` are `Runtime`'s (each replica gets them with `dp_size=1`). Own options:
    `replica_backend` ('process' | 'ray'), `ray_address` (for 'ray': a cluster to join; None
    joins the running one or starts a local one), `ray_runtime_env` (Ray's `runtime_env` for the
    actors), `router` (a `RouterConfig` or a dict of its fields: policy, balance thresholds),
    `event_poll_interval` (seconds between eviction polls), `startup_timeout` (seconds, per
    replica). `device` and `dtype` are the replicas' ('auto' puts one replica on each GPU).
    """

    def __init__(self, model_path: str | Path | None = None, *, dp_size: int = 2,
                 replica_backend: str = "process", ray_address: str | None = None,
                 ray_runtime_env: dict[str, Any] | None = None,
                 router: RouterConfig | dict[str, Any] | None = None,
                 event_poll_interval: float = 0.25, startup_timeout: float = 600.0,
                 **options: Any) -> None:
        if replica_backend not in REPLICA_BACKENDS:
            raise ValueError(f"unknown replica_backend {replica_backend!r}; choose one of: "
                             f"{', '.join(REPLICA_BACKENDS)}")
        config = EngineConfig.from_options(model_path=model_path, dp_size=dp_size, **options)
        self.engine_config = config
        self.dp_size = config.dp_size
        self.replica_backend = replica_backend
        self.device, self.dtype = config.device, config.dtype
        self.model_dir = loader.resolve_model_dir(config.model_path)
        self.model_config = loader.load_model_config(self.model_dir)
        self.tokenizer = loader.load_tokenizer(
            loader.resolve_tokenizer_dir(config.tokenizer_path or self.model_dir))
        self.media_processor: MediaProcessor | None = None  # media are not routed yet
        self.event_poll_interval = event_poll_interval
        self._ray_runtime_env = ray_runtime_env
        router_config = router if isinstance(router, RouterConfig) else RouterConfig(
            **(router or {}))
        self._tokenizer_lock = threading.Lock()
        self._lock = threading.Lock()  # the router's state
        self._rids = itertools.count()
        self._closed = False
        self._owns_ray = False
        self._event_seq = [0] * self.dp_size
        self._calls: set[concurrent.futures.Future] = set()
        replica_options = {f.name: getattr(config, f.name)
                           for f in dataclasses.fields(config)
                           if getattr(config, f.name) != f.default and f.name != "model_path"}
        replica_options.pop("dp_size", None)
        if config.tokenizer_path is None:
            replica_options.pop("tokenizer_path", None)
        self._loop = _LoopThread()
        try:
            self.replicas: list[Replica] = self._start_replicas(
                str(self.model_dir), replica_options, ray_address=ray_address,
                startup_timeout=startup_timeout)
        except BaseException:
            self._loop.stop()
            if self._owns_ray:
                import ray

                ray.shutdown()
            raise
        self.context_len = min(r.context_len for r in self.replicas)
        self.max_total_tokens = sum(r.max_total_tokens for r in self.replicas)
        self.router = Router(self.dp_size, router_config,
                             capacities=[r.max_total_tokens for r in self.replicas])
        self._poll_lock: asyncio.Lock | None = None
        self._poller = self._loop.spawn(self._poll_forever())
        try:
            self.sync_cache_events()  # starts each replica's event log before any request
        except BaseException:
            self.close()
            raise

    # ---- replicas --------------------------------------------------------------------------------
    def _start_replicas(self, model_path: str, options: dict[str, Any], *,
                        ray_address: str | None, startup_timeout: float) -> list[Replica]:
        device = options.get("device", "auto")
        replicas: list[Any] = []
        try:
            if self.replica_backend == "ray":
                from lmnb.runtime.distributed.ray_replica import RayReplica

                self._init_ray(ray_address)
                gpu = self._ray_has_gpus(device)  # the cluster's GPUs, not this machine's
                if gpu:
                    options = {**options, "device": "cuda"}
                for i in range(self.dp_size):
                    replicas.append(RayReplica.launch(
                        i, model_path, options, num_gpus=1 if gpu else 0,
                        runtime_env=self._ray_runtime_env))
            else:
                gpus = self._gpu_ids(device)
                if gpus:
                    options = {**options, "device": "cuda"}
                for i in range(self.dp_size):
                    env = self._replica_env(i, gpus)
                    replicas.append(ProcessReplica.launch(i, model_path, options, env=env))
            for replica in replicas:
                replica.wait_ready(startup_timeout)
        except BaseException:
            for replica in replicas:
                replica.close()
            raise
        return replicas

    @staticmethod
    def _ray_has_gpus(device: str) -> bool:
        import ray

        if device == "cpu":
            return False
        gpus = ray.cluster_resources().get("GPU", 0)
        if gpus == 0 and device != "auto":
            raise ValueError(f"device={device!r}, but the Ray cluster has no GPU")
        return gpus > 0

    def _gpu_ids(self, device: str) -> list[str]:
        """The GPUs replicas go on, one each in turn (empty on CPU)."""
        if device == "cpu":
            return []
        import torch

        count = torch.cuda.device_count()
        if count == 0:
            if device != "auto":
                raise ValueError(f"device={device!r}, but no CUDA device is visible")
            return []
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [v.strip() for v in visible.split(",")] if visible else [str(i) for i in
                                                                       range(count)]
        return ids[:count]

    def _replica_env(self, index: int, gpus: list[str]) -> dict[str, str]:
        if gpus:
            return {"CUDA_VISIBLE_DEVICES": gpus[index % len(gpus)]}
        if "OMP_NUM_THREADS" in os.environ:
            return {}
        # CPU replicas share the cores instead of each taking all of them
        return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // self.dp_size))}

    def _init_ray(self, address: str | None) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
            self._owns_ray = True

    # ---- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """Stops the event poller, aborts what is in flight, stops every replica."""
        if self._closed:
            return
        self._closed = True
        self._poller.cancel()
        for call in list(self._calls):
            call.cancel()

        async def close_clients() -> None:
            for replica in self.replicas:
                await replica.aclose()

        try:
            self._loop.call(close_clients(), timeout=10.0)
        except Exception:  # a client that cannot close cleanly still goes with its replica
            pass
        for replica in self.replicas:  # all stop at once
            replica.begin_close()
        for replica in self.replicas:
            replica.close()
        self._loop.stop()
        if self._owns_ray:
            import ray

            ray.shutdown()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def failed(self) -> bool:
        """Every replica died."""
        return not any(self.router.alive)

    def __enter__(self) -> DataParallelRuntime:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def shutdown(self) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this DataParallelRuntime is closed; create a new one")
        if self.failed:
            raise RuntimeError("every data-parallel replica has died")

    # ---- cache events ----------------------------------------------------------------------------
    def sync_cache_events(self) -> None:
        """Applies every replica's eviction events reported so far (the poller does this every
        `event_poll_interval` s; tests call it to read a settled meta tree)."""
        self._check_open()
        self._loop.call(self._poll_events())

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.event_poll_interval)
            try:
                await self._poll_events()
            except asyncio.CancelledError:
                raise
            except Exception:  # a transient failure; the next poll retries
                pass

    async def _poll_events(self) -> None:
        if self._poll_lock is None:
            self._poll_lock = asyncio.Lock()
        async with self._poll_lock:  # one poll at a time: each event is applied once
            for i, replica in enumerate(self.replicas):
                if not self.router.alive[i]:
                    continue
                with self._lock:
                    upto = self.router.stamp()
                try:
                    report = await replica.cache_events(self._event_seq[i])
                except ReplicaDiedError:
                    self._replica_died(i)
                    continue
                except Exception:  # cut off but alive: the next poll asks again
                    continue
                with self._lock:
                    self.router.apply_events(i, report, upto)
                self._event_seq[i] = report["seq"]

    def _replica_died(self, index: int) -> None:
        with self._lock:
            self.router.mark_dead(index)

    # ---- introspection ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The replicas' counters summed (hit rate over all of them), each replica's own under
        `replicas`, and the router's (`router`: routed requests, in flight, meta tree size)."""
        self._check_open()
        live = [i for i in range(self.dp_size) if self.router.alive[i]]

        async def gather() -> list[Any]:
            return await asyncio.gather(*(self.replicas[i].stats() for i in live),
                                        return_exceptions=True)

        per_replica: list[dict[str, Any]] = [{"alive": False} for _ in range(self.dp_size)]
        for i, result in zip(live, self._loop.call(gather()), strict=True):
            if isinstance(result, ReplicaDiedError):
                self._replica_died(i)
            elif isinstance(result, dict):
                per_replica[i] = {**result, "alive": True}
            else:
                per_replica[i] = {"alive": True, "error": f"{type(result).__name__}: {result}"}
        served = [s for s in per_replica if s["alive"] and "error" not in s]
        stats: dict[str, Any] = dict(served[0]) if served else {}
        stats.pop("alive", None)
        for key in _SUMMED:
            stats[key] = sum(s.get(key, 0) for s in served)
        stats["cache_hit_rate"] = stats["cached_tokens"] / max(stats["prompt_tokens"], 1)
        stats["recent_cache_hit_rate"] = (sum(s.get("recent_cache_hit_rate", 0.0)
                                              for s in served) / max(len(served), 1))
        with self._lock:
            stats["router"] = self.router.stats()
        stats.update(dp_size=self.dp_size, replica_backend=self.replica_backend,
                     replicas=[{**s, "description": r.description}
                               for s, r in zip(per_replica, self.replicas, strict=True)])
        return stats

    def flush_cache(self) -> bool:
        """Empties every live replica's prefix cache; False if any refused (requests in flight)."""
        self._check_open()
        live = [i for i in range(self.dp_size) if self.router.alive[i]]

        async def flush() -> list[Any]:
            results = await asyncio.gather(*(self.replicas[i].flush_cache() for i in live),
                                           return_exceptions=True)
            # take the replicas' reset events now: read later, they would also erase what
            # requests routed after the flush put in the meta tree
            await self._poll_events()
            return results

        flushed = True
        for i, result in zip(live, self._loop.call(flush()), strict=True):
            if result is True:
                with self._lock:
                    self.router.forget(i)
            else:
                flushed = False
                if isinstance(result, ReplicaDiedError):
                    self._replica_died(i)
        return flushed

    def use_router(self, config: RouterConfig | dict[str, Any]) -> None:
        """Routes with a new policy from now on (a baseline, e.g. round robin, measured on the
        same replicas). Empties every cache first, so the new router's meta tree is true;
        RuntimeError while requests are in flight."""
        config = config if isinstance(config, RouterConfig) else RouterConfig(**config)
        with self._lock:
            if any(self.router.loads):
                raise RuntimeError("use_router: requests are in flight")
        if not self.flush_cache():
            raise RuntimeError("use_router: a replica refused to flush its cache")
        with self._lock:
            router = Router(self.dp_size, config,
                            capacities=[r.max_total_tokens for r in self.replicas])
            router.alive = list(self.router.alive)
            self.router = router

    def cache_snapshot(self, preview_tokens: int = 16) -> list[dict[str, Any]]:
        """Empty: the radix trees live in the replicas (see `stats()["router"]`)."""
        return []

    # ---- media (not routed yet) ------------------------------------------------------------------
    @property
    def image_token(self) -> str | None:
        return None

    @property
    def video_token(self) -> str | None:
        return None

    # ---- tokenizer -------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as `generate` would feed them (special tokens added)."""
        with self._tokenizer_lock:
            return self.tokenizer.encode(text, add_special_tokens=True)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                            add_generation_prompt: bool = True, *,
                            tools: list[dict[str, Any]] | None = None,
                            template_kwargs: Mapping[str, Any] | None = None) -> str:
        with self._tokenizer_lock:
            return apply_chat_template(self.tokenizer, messages,
                                       add_generation_prompt=add_generation_prompt, tools=tools,
                                       template_kwargs=template_kwargs)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # ---- generation ------------------------------------------------------------------------------
    def cache_prefix(self, prompt: str | None = None, *,
                     input_ids: Sequence[int] | None = None) -> int:
        """Prefills `prompt` on the replica the router picks for it (so a fork's branches, which
        share it, follow it there); returns its token count."""
        out = self.generate(prompt, {"max_new_tokens": 0}, input_ids=input_ids)
        if isinstance(out, list):
            raise InvalidRequestError("cache_prefix takes one prompt")
        return out["meta_info"]["prompt_tokens"]

    def pin_prefix(self, prompt: str | None = None, *,
                   input_ids: Sequence[int] | None = None) -> int:
        """Not served: each replica has a cache of its own, and a pin would hold one of them
        while the router may send the prefix's requests to another."""
        raise InvalidRequestError("pin_prefix is not supported with dp_size > 1 (each replica "
                                  "caches on its own); cache_prefix caches a prefix on the "
                                  "replica its requests are routed to")

    def unpin_prefix(self, pin_id: int) -> bool:
        """No pins are held (`pin_prefix`)."""
        return False

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
        """As `Runtime.generate`; each prompt (with its `n` samples) goes to the replica the
        router picks, and `meta_info["dp_rank"]` says which. Media inputs are not routed yet."""
        self._check_open()
        if image_data is not None or video_data is not None:
            raise InvalidRequestError("a data-parallel runtime does not take images or videos "
                                      "yet; use a single Runtime")
        token_lists, is_batch = prompt_id_lists(prompt, input_ids, self.encode)
        # the checks of `Runtime.generate`, so that errors come before anything is sent
        params_list = request_checks.params_dicts(sampling_params, len(token_lists))
        parsed = request_checks.params_list(params_list, len(token_lists))
        logprobs, token_ids = request_checks.logprob_requests(
            return_logprob, logprob_start_len, top_logprobs_num, token_ids_logprob,
            count=len(token_lists), is_batch=is_batch, vocab_size=self.model_config.vocab_size,
            always=return_token_origins)
        for ids, params, options in zip(token_lists, parsed, logprobs, strict=True):
            request_checks.check_prompt(ids, params, context_len=self.context_len,
                                        vocab_size=self.model_config.vocab_size,
                                        logprob_start=options.start,
                                        allow_auto_truncate=self.engine_config.allow_auto_truncate)
        counts = [params.n for params in parsed]
        with self._lock:
            choices = [self.router.route(ids, weight=count)
                       for ids, count in zip(token_lists, counts, strict=True)]
        rids = [next(self._rids) for _ in range(sum(counts))]
        single = not is_batch and len(rids) == 1
        calls: list[concurrent.futures.Future] = []
        first = list(itertools.accumulate([0, *counts]))
        keys = [f"lmnb-dp-{rids[first[p]]}" for p in range(len(token_lists))]
        names: dict[int, tuple[int, str]] = {}  # rid -> (replica, its name there)
        output = OutputStream(rids, incremental=stream and incremental,
                              tagged=stream and not single,
                              on_close=lambda unfinished: self._end(output, calls, names,
                                                                    unfinished),
                              poll=self._check_open)
        token_texts = (TokenTexts(self.tokenizer) if return_text_in_logprobs and any(
            options.return_logprob for options in logprobs) else None)  # (logprob, id, text)
        for replica in sorted(set(choices)):
            prompts = [p for p, c in enumerate(choices) if c == replica]
            request = {"input_ids": [token_lists[p] for p in prompts],
                       "sampling_params": [params_list[p] for p in prompts],
                       "rid": [keys[p] for p in prompts],
                       "return_logprob": [logprobs[p].return_logprob for p in prompts],
                       "logprob_start_len": [asked_start(logprobs[p].start) for p in prompts],
                       "top_logprobs_num": [logprobs[p].top for p in prompts],
                       "token_ids_logprob": [token_ids[p] for p in prompts],
                       "return_token_origins": return_token_origins}
            outputs = [(rids[first[p] + k], token_lists[p]) for p in prompts
                       for k in range(counts[p])]
            names.update(zip((rid for rid, _ in outputs),
                             ((replica, name) for name in output_names(
                                 request["rid"], [counts[p] for p in prompts])), strict=True))
            shifted = [asked_start(logprobs[p].start) != logprobs[p].start for p in prompts
                       for _ in range(counts[p])]
            call = self._loop.spawn(self._serve(replica, request, output.incremental, outputs,
                                                output, token_texts=token_texts,
                                                shifted=shifted))
            calls.append(call)
            self._calls.add(call)
            call.add_done_callback(self._calls.discard)
        if stream:
            return output
        with output:  # an interrupt (Ctrl-C) closes it, which cancels the replicas' requests
            results = output.results()
        return results[0] if single else results

    @contextmanager
    def batched_submits(self) -> Iterator[None]:
        """`Runtime.batched_submits`'s block: holds nothing here. Each `generate` is one HTTP
        call per replica, served by the replica's own runtime as it arrives."""
        yield

    def _end(self, output: OutputStream, calls: list[concurrent.futures.Future],
             names: dict[int, tuple[int, str]], unfinished: list[int]) -> None:
        """A closed stream cancels its calls (the replicas abort what they serve); an abort of
        some of its requests asks their replicas to end them, and their last chunks (finish
        reason abort) still arrive."""
        if output.closed:
            for call in calls:
                call.cancel()
            return
        for rid in unfinished:
            replica, name = names[rid]
            self._loop.spawn(self._abort(replica, name))

    async def _abort(self, replica: int, name: str) -> None:
        try:
            await self.replicas[replica].abort(name)
        except Exception:  # a replica that died fails the request's own call
            pass

    async def _serve(self, replica: int, request: dict[str, Any], stream: bool,
                     outputs: list[tuple[int, list[int]]], output: OutputStream, *,
                     token_texts: TokenTexts | None = None,
                     shifted: list[bool] | None = None) -> None:
        """Relays one replica's part of a generate call into `output`; keeps loads and the meta
        tree current. `shifted[i]`: output i's prompt lists were asked one position early
        (`logprob_lists.asked_start`), their first entries are dropped."""
        produced: dict[int, list[int]] = {}
        done: set[int] = set()
        try:
            async for chunk in self.replicas[replica].generate(request, stream=stream):
                index = chunk["index"]
                rid, prompt_ids = outputs[index]
                meta = {**chunk["meta_info"], "id": str(rid), "dp_rank": replica}
                if shifted is not None and shifted[index]:
                    meta.update((key, meta[key][1:]) for key in PROMPT_LISTS if meta.get(key))
                if token_texts is not None:
                    meta = with_token_texts(meta, token_texts)
                out = {"text": chunk["text"], "output_ids": chunk["output_ids"],
                       "meta_info": meta}
                if output.tagged:
                    out["index"] = output.index[rid]
                ids = produced.setdefault(index, [])
                ids.extend(chunk["output_ids"])
                if meta.get("finish_reason") is not None:
                    done.add(index)
                    with self._lock:  # what the replica now caches: prompt + output but the last
                        self.router.finished(replica, len(prompt_ids), prompt_ids + ids[:-1])
                output.deliver([out])
        except asyncio.CancelledError:
            if self._closed:  # a reader waiting on this stream must not wait forever
                output.fail(RuntimeError("the DataParallelRuntime was closed"))
            raise
        except ReplicaDiedError as error:
            self._replica_died(replica)
            output.fail(error)
        except Exception as error:  # an invalid request, a lost connection: this call fails
            output.fail(error)
        finally:
            with self._lock:
                for index, (_, prompt_ids) in enumerate(outputs):
                    if index not in done:
                        self.router.finished(replica, len(prompt_ids))

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{sum(self.router.alive)} alive"
        return (f"DataParallelRuntime({self.model_dir.name}, dp_size={self.dp_size}, "
                f"{self.replica_backend}, {state})")
