"""Data-parallel replicas as local processes: each one is `python -m lmnb serve MODEL --port 0
--watch-stdin`, a whole `Runtime` behind our own server, reached over loopback HTTP (httpx) on
the port it picked and announced. `Replica` is the protocol the router's runtime drives; the Ray
actors of `ray_replica.py` implement it too.

Why processes and HTTP: a replica must own its device and its GIL, survive (or not) on its own,
and be killable; the SGLang-native `/generate` route already streams, validates and aborts on
disconnect, so the transport is an existing, tested engine rather than a new one. The child
watches its stdin: when this process dies (even by SIGKILL), the pipe closes and the replica stops,
so no orphan holds a GPU after a kernel restart.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from lmnb.params import InvalidRequestError
from lmnb.runtime.output.logprob_lists import running_form
from lmnb.runtime.output.logprob_text import TOKEN_LOGPROB_KEYS, TOP_LOGPROB_KEYS
from lmnb.runtime.prefix_cache import common_prefix_length

if TYPE_CHECKING:
    import httpx

READY_PREFIX = "lmnb: serving on "  # `python -m lmnb serve --port 0` prints this + its URL

Chunk = dict[str, Any]


class ReplicaError(RuntimeError):
    """A replica failed to serve a request (it is still alive)."""


class ReplicaDiedError(ReplicaError):
    """A replica process or actor died; the requests it was serving failed with this."""


class Replica(Protocol):
    """One data-parallel replica, driven from the router's event loop.

    `generate(request, stream=)` yields chunks `{"index", "text", "output_ids", "meta_info"}`
    for the request's outputs (`index` counts outputs in order, `n` samples per prompt
    consecutive): incremental ones with `stream=True`, one whole chunk per output at its end
    otherwise. Logprobs come as `(logprob, token_id)` pairs, as `Runtime.generate` gives them.
    Cancelling the consuming task aborts the replica's requests; `abort(name)` ends one of them
    (named by `output_names` from the request's `rid` keys) with finish_reason `abort`, which
    its stream still delivers. A dead replica raises `ReplicaDiedError`."""

    index: int
    description: str
    context_len: int
    max_total_tokens: int

    def generate(self, request: dict[str, Any], *, stream: bool) -> AsyncIterator[Chunk]: ...
    async def abort(self, name: str) -> None: ...
    async def cache_events(self, since: int) -> dict[str, Any]: ...
    async def stats(self) -> dict[str, Any]: ...
    async def flush_cache(self) -> bool: ...
    async def aclose(self) -> None: ...
    def begin_close(self) -> None: ...
    def close(self) -> None: ...


def output_names(keys: list[str], counts: list[int]) -> list[str]:
    """The name of each output of a request whose prompts have `rid` `keys` and `counts`
    samples (SGLang's: the key itself, or `key_k` for sample k of `n` > 1), in output order."""
    return [key if n == 1 else f"{key}_{k}" for key, n in zip(keys, counts, strict=True)
            for k in range(n)]


def as_pairs(meta: dict[str, Any]) -> dict[str, Any]:
    """SGLang's `[logprob, id, text]` triples back to the runtime's `(logprob, id)` pairs."""

    def pair(item: Any) -> tuple[Any, int]:
        return item[0], item[1]

    out = dict(meta)
    for key in TOKEN_LOGPROB_KEYS:
        if out.get(key) is not None:
            out[key] = [pair(p) for p in out[key]]
    for key in TOP_LOGPROB_KEYS:
        if out.get(key) is not None:
            out[key] = [None if row is None else [pair(p) for p in row] for row in out[key]]
    return out


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment, with lmnb importable from where this file is."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[3])
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([root, *[p for p in paths if p != root]])
    env.update(extra or {})
    return env


class ProcessReplica:
    """A `python -m lmnb serve` child on a loopback port it picked itself."""

    def __init__(self, index: int, process: subprocess.Popen) -> None:
        self.index = index
        self.process = process
        self.url: str | None = None
        self.context_len = 0
        self.max_total_tokens = 0
        self._ready = threading.Event()
        self._output: collections.deque[str] = collections.deque(maxlen=60)
        self._reader = threading.Thread(target=self._read_output, daemon=True,
                                         name=f"lmnb-replica-{index}-output")
        self._reader.start()
        self._client: httpx.AsyncClient | None = None  # made on the router's loop

    @classmethod
    def launch(cls, index: int, model_path: str | None, options: dict[str, Any], *,
               env: dict[str, str] | None = None) -> ProcessReplica:
        """Starts the child (returns at once; `wait_ready` waits for its URL)."""
        command = [sys.executable, "-m", "lmnb", "serve", *([model_path] if model_path else []),
                   "--host", "127.0.0.1", "--port", "0", "--watch-stdin",
                   "--log-level", "warning", "--engine-options", json.dumps(options)]
        process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=child_env(env), text=True, bufsize=1,
            start_new_session=True)  # a Ctrl-C in a terminal reaches the parent, not replicas
        return cls(index, process)

    def _read_output(self) -> None:
        """Finds the URL line, then keeps draining (the tail explains a failure)."""
        for line in self.process.stdout:
            line = line.rstrip("\n")
            if self.url is None and line.startswith(READY_PREFIX):
                self.url = line[len(READY_PREFIX):].strip()
                self._ready.set()
            else:
                self._output.append(line)
        self._ready.set()  # end of output: the process is gone

    def output_tail(self, lines: int = 20) -> str:
        return "\n".join(list(self._output)[-lines:])

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def description(self) -> str:
        return f"replica {self.index}: pid {self.pid} at {self.url or 'starting'}"

    def wait_ready(self, timeout: float) -> None:
        """Blocks until the child serves; reads its sizes. RuntimeError if it exits first."""
        import httpx

        if not self._ready.wait(timeout) or self.url is None:
            code = self.process.poll()
            why = "did not start in time" if code is None else f"exited with code {code}"
            raise RuntimeError(f"data-parallel {self.description} {why}:\n{self.output_tail()}")
        info = httpx.get(f"{self.url}/get_server_info", timeout=60.0).json()
        self.context_len = int(info["context_length"])
        self.max_total_tokens = int(info["max_total_num_tokens"])

    # ---- requests (on the router's event loop) ---------------------------------------------------
    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            import httpx

            self._client = httpx.AsyncClient(
                base_url=self.url, timeout=httpx.Timeout(None, connect=30.0),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=32))
        return self._client

    async def generate(self, request: dict[str, Any], *, stream: bool) -> AsyncIterator[Chunk]:
        import httpx

        body = {**request, "stream": stream}
        try:
            if not stream:
                response = await self._http().post("/generate", json=body)
                if response.status_code != 200:
                    raise self._request_error(response.status_code, response.text)
                results = response.json()
                for index, result in enumerate(results):
                    yield {"index": index, "text": result["text"],
                           "output_ids": result["output_ids"],
                           "meta_info": as_pairs(result["meta_info"])}
                return
            async with self._http().stream("POST", "/generate", json=body) as response:
                if response.status_code != 200:
                    raise self._request_error(response.status_code,
                                              (await response.aread()).decode())
                async for chunk in self._deltas(response):
                    yield chunk
        except httpx.TransportError as error:
            raise await self._failure(error) from None

    async def _deltas(self, response: httpx.Response) -> AsyncIterator[Chunk]:
        """SGLang's cumulative stream events as incremental chunks, their running meta_info in
        the runtime's running form (`logprob_lists.running_form`)."""
        texts: dict[int, int] = {}
        ids: dict[int, list[int]] = {}  # by index, the output ids delivered
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload == "[DONE]":
                return
            event = json.loads(payload)
            if "error" in event:
                raise ReplicaError(f"data-parallel {self.description}: "
                                   f"{event['error'].get('message')}")
            index = event.get("index", 0)
            text, output_ids = event["text"], event["output_ids"]
            meta = as_pairs(event["meta_info"])
            before = ids.get(index)
            # a jump-forward re-tokenizes the tail: the ids (and rows) from the first it changed
            start = common_prefix_length(before or [], output_ids)
            if meta.get("finish_reason") is None:
                meta.pop("completion_tokens", None)  # the runtime's own chunks count at the end
                meta = running_form(meta, start, with_prompt=before is None)
            if before is not None and start < len(before):
                meta["output_ids_from"] = start
            yield {"index": index, "text": text[texts.get(index, 0):],
                   "output_ids": output_ids[start:], "meta_info": meta}
            texts[index], ids[index] = len(text), output_ids
        raise ReplicaError(f"data-parallel {self.description} ended a stream early")

    def _request_error(self, status: int, body: str) -> Exception:
        try:
            message = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = body.strip()
        if status == 400:
            return InvalidRequestError(message)
        return ReplicaError(f"data-parallel {self.description} answered {status}: {message}")

    async def _failure(self, error: Exception) -> ReplicaError:
        """A transport error: dead (the process exits within a few seconds) or just cut off."""
        code = await asyncio.to_thread(self._exit_code, 5.0)
        if code is not None:
            return ReplicaDiedError(
                f"data-parallel {self.description} died (exit code {code}) while serving "
                f"this request; the router keeps serving on the other replicas")
        return ReplicaError(f"lost the connection to data-parallel {self.description}: "
                            f"{type(error).__name__}: {error}")

    def _exit_code(self, timeout: float) -> int | None:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    async def _get(self, path: str, **params: Any) -> Any:
        import httpx

        try:
            response = await self._http().get(path, params=params)
        except httpx.TransportError as error:
            raise await self._failure(error) from None
        if response.status_code != 200:
            raise self._request_error(response.status_code, response.text)
        return response.json()

    async def abort(self, name: str) -> None:
        import httpx

        try:
            await self._http().post("/abort_request", json={"rid": name})
        except httpx.TransportError:  # a dead replica fails the request's call itself
            pass

    async def cache_events(self, since: int) -> dict[str, Any]:
        return await self._get("/lmnb/cache_events", since=since)

    async def stats(self) -> dict[str, Any]:
        return (await self._get("/get_server_info"))["internal_states"][0]

    async def flush_cache(self) -> bool:
        import httpx

        try:
            response = await self._http().post("/flush_cache")
        except httpx.TransportError as error:
            raise await self._failure(error) from None
        return response.status_code == 200

    # ---- lifecycle -------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    async def aclose(self) -> None:
        """Closes the HTTP client (on the loop that made it)."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def begin_close(self) -> None:
        """Closes the child's stdin: it stops its server and runtime and exits."""
        try:
            self.process.stdin.close()
        except OSError:  # it is gone already
            pass

    def close(self, timeout: float = 15.0) -> None:
        """`begin_close`, waits for the exit, then insists."""
        if self.process.poll() is None:
            self.begin_close()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.terminate()
                try:
                    self.process.wait(5.0)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
        self._reader.join(5.0)
        if self.process.stdout is not None:
            self.process.stdout.close()
