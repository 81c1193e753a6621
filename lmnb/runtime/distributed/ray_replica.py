"""Data-parallel replicas as Ray actors: one `Runtime` per actor, on any node of a Ray cluster
(`ray.init(address=...)`), behind the same router as local process replicas.

The actor is asynchronous: `generate` is a Ray streaming generator that relays the runtime's own
`OutputStream` (`async for`), so chunks arrive as they are produced and cancelling the generator
(`ray.cancel`) closes the stream, which aborts the requests. A dead actor (its node lost, its
process killed) surfaces as `RayActorError`, which the client side turns into
`ReplicaDiedError`. Every node needs lmnb installed and the model at the same path.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

from lmnb.runtime.distributed.replica import ReplicaDiedError, ReplicaError, output_names

Chunk = dict[str, Any]


class ReplicaActor:
    """The actor's body (made remote by `RayReplica.launch`): a Runtime in the actor process."""

    def __init__(self, model_path: str | None, options: dict[str, Any]) -> None:
        from lmnb.runtime.engine import Runtime

        self.runtime = Runtime(model_path, **options)
        self._open_outputs: dict[str, tuple[Any, int]] = {}  # name -> (stream, engine rid)

    async def info(self) -> dict[str, Any]:
        import ray

        return {"context_len": self.runtime.context_len,
                "max_total_tokens": self.runtime.max_total_tokens, "pid": os.getpid(),
                "node": ray.util.get_node_ip_address()}

    async def _open(self, request: dict[str, Any]) -> Any:
        return await asyncio.to_thread(
            self.runtime.generate, input_ids=request["input_ids"],
            sampling_params=request["sampling_params"],
            return_logprob=request.get("return_logprob", False),
            logprob_start_len=request.get("logprob_start_len"),
            top_logprobs_num=request.get("top_logprobs_num"),
            token_ids_logprob=request.get("token_ids_logprob"),
            return_token_origins=request.get("return_token_origins", False), stream=True)

    def _name(self, request: dict[str, Any], stream: Any) -> list[str]:
        """Registers the request's outputs under their names (`abort` finds them)."""
        counts = [params.get("n", 1) for params in request["sampling_params"]]
        names = output_names(request["rid"], counts) if request.get("rid") else []
        self._open_outputs.update(zip(names, ((stream, rid) for rid in stream.rids), strict=False))
        return names

    def _forget(self, names: list[str]) -> None:
        for name in names:
            self._open_outputs.pop(name, None)

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[Chunk]:
        """Incremental chunks, tagged with `index` (a Ray streaming generator)."""
        stream = await self._open(request)
        names = self._name(request, stream)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            self._forget(names)
            stream.close()  # cancelled or done: unfinished requests are aborted

    async def generate_whole(self, request: dict[str, Any]) -> list[Chunk]:
        stream = await self._open(request)
        names = self._name(request, stream)
        try:
            return await stream.aresults()  # a cancelled await closes the stream (aborts)
        finally:
            self._forget(names)

    async def abort(self, name: str) -> None:
        """Ends the output `name` with finish_reason abort (a finished one: nothing)."""
        if name in self._open_outputs:
            stream, rid = self._open_outputs[name]
            stream.abort(rid)

    async def cache_events(self, since: int) -> dict[str, Any]:
        return await asyncio.to_thread(self.runtime.cache_events, since)

    async def stats(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.runtime.stats)

    async def flush_cache(self) -> bool:
        return await asyncio.to_thread(self.runtime.flush_cache)

    async def close(self) -> None:
        await asyncio.to_thread(self.runtime.close)


class RayReplica:
    """Client side of one `ReplicaActor` (the `Replica` protocol)."""

    def __init__(self, index: int, actor: Any, ready: Any) -> None:
        self.index = index
        self.actor = actor
        self._ready = ready
        self.context_len = 0
        self.max_total_tokens = 0
        self.node: str | None = None
        self.pid: int | None = None
        self._dead = False
        self._closing: Any = None

    @classmethod
    def launch(cls, index: int, model_path: str | None, options: dict[str, Any], *,
               num_gpus: float = 0, num_cpus: float = 1,
               runtime_env: dict[str, Any] | None = None) -> RayReplica:
        """Creates the actor (returns at once; `wait_ready` waits for its model to load)."""
        import ray

        remote = ray.remote(ReplicaActor).options(
            num_gpus=num_gpus, num_cpus=num_cpus, max_concurrency=1000, max_restarts=0,
            **({"runtime_env": runtime_env} if runtime_env else {}))
        actor = remote.remote(model_path, options)
        return cls(index, actor, actor.info.remote())

    @property
    def description(self) -> str:
        where = f"pid {self.pid} on {self.node}" if self.pid else "starting"
        return f"replica {self.index}: Ray actor, {where}"

    def wait_ready(self, timeout: float) -> None:
        import ray

        try:
            info = ray.get(self._ready, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"data-parallel {self.description} did not start in time") \
                from None
        except ray.exceptions.RayError as error:
            raise RuntimeError(f"data-parallel {self.description} failed to start: {error}") \
                from None
        self.context_len, self.max_total_tokens = info["context_len"], info["max_total_tokens"]
        self.node, self.pid = info["node"], info["pid"]

    def _failure(self, error: Exception) -> ReplicaError:
        import ray

        if isinstance(error, ray.exceptions.RayActorError):
            self._dead = True
            return ReplicaDiedError(
                f"data-parallel {self.description} died while serving this request; the "
                f"router keeps serving on the other replicas ({type(error).__name__})")
        return ReplicaError(f"data-parallel {self.description}: {error}")

    async def generate(self, request: dict[str, Any], *, stream: bool) -> AsyncIterator[Chunk]:
        import ray

        if not stream:
            ref = self.actor.generate_whole.remote(request)
            try:
                results = await ref
            except asyncio.CancelledError:
                ray.cancel(ref)
                raise
            except ray.exceptions.RayError as error:
                raise self._error(error) from None
            for index, result in enumerate(results):
                yield {"index": index, **result}
            return
        chunks = self.actor.generate.remote(request)
        finished = False
        try:
            async for ref in chunks:
                chunk = await ref
                chunk.setdefault("index", 0)
                yield chunk
            finished = True
        except ray.exceptions.RayError as error:
            raise self._error(error) from None
        finally:
            if not finished:
                ray.cancel(chunks)

    def _error(self, error: Exception) -> Exception:
        """The runtime's own request errors pass through; actor deaths become ours."""
        import ray

        if isinstance(error, ray.exceptions.RayTaskError):
            cause = error.as_instanceof_cause()
            if isinstance(cause, ValueError):  # InvalidRequestError and friends
                return cause
        return self._failure(error)

    async def _call(self, method: Any, *args: Any) -> Any:
        """`method` (one of the actor's `ActorMethod`s) run remotely; Ray's errors as ours."""
        import ray

        try:
            return await method.remote(*args)
        except ray.exceptions.RayError as error:
            raise self._error(error) from None

    async def abort(self, name: str) -> None:
        await self._call(self.actor.abort, name)

    async def cache_events(self, since: int) -> dict[str, Any]:
        return await self._call(self.actor.cache_events, since)

    async def stats(self) -> dict[str, Any]:
        return await self._call(self.actor.stats)

    async def flush_cache(self) -> bool:
        return await self._call(self.actor.flush_cache)

    @property
    def alive(self) -> bool:
        return not self._dead

    async def aclose(self) -> None:
        pass

    def begin_close(self) -> None:
        """Asks the actor to close its runtime (all replicas close at once)."""
        if not self._dead and self._closing is None:
            self._closing = self.actor.close.remote()

    def close(self, timeout: float = 15.0) -> None:
        """Closes the runtime in the actor, then ends the actor."""
        import ray

        self.begin_close()
        if self._closing is not None:
            try:
                ray.get(self._closing, timeout=timeout)
            except ray.exceptions.RayError:
                pass
        ray.kill(self.actor, no_restart=True)
        self._dead = True
