"""Tensor-parallel ranks 1..N-1: worker processes that rank 0 (the Runtime's process) spawns,
commands and stops.

    rank 0 (TPWorkers)                        rank r (worker_main, a spawned process)
    TCPStore on a free port, spawn r -------> boots (imports torch)
    tokenizer, load_model(shard 0)            load_model(shard r); "ready" through its pipe
    connect: waits for every "ready", joins <-> joins (rendezvous through the store)
    RUNNER: ModelRunner (KV size: min) <----> ModelRunner
    CAPTURE n: decode graphs <--------------> decode graphs          (CUDA)
    FORWARD each scheduler step ------------> follow: the same pass on shard r
    STOP (close) ---------------------------> leaves; rank 0 joins it

No orphans: a worker exits when its parent process dies (it waits on the parent's sentinel in a
thread; a closed socket also ends any collective it is in). A worker that dies is noticed by
rank 0 (`check`, through the processes' states), and its last error, sent through its pipe,
becomes part of the Runtime's error.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import threading
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lmnb.runtime.config import EngineConfig, ModelConfig
from lmnb.runtime.distributed.group import STORE_HOST, TPError, TPGroup
from lmnb.runtime.distributed.step import Command

JOIN_TIMEOUT_S = 60.0  # a stopping worker that has not left by then is terminated
STORE_TIMEOUT = timedelta(minutes=5)  # rendezvous: every worker has said "ready" before it
FAULT_ENV = "LMNB_TP_FAULT"  # tests: "RANK:load" makes that worker fail loading its shard


def _worker_devices(device: torch.device, size: int) -> list[torch.device]:
    """Rank r's device: cuda:(base + r) where rank 0 is on cuda:base; the CPU for every rank."""
    if device.type != "cuda":
        return [torch.device("cpu")] * size
    base = device.index if device.index is not None else 0
    count = torch.cuda.device_count()
    if base + size > count:
        raise ValueError(f"tp_size={size} from cuda:{base} needs {base + size} GPUs; "
                         f"{count} are visible")
    return [torch.device("cuda", base + rank) for rank in range(size)]


class TPWorkers:
    """Rank 0's side: spawns ranks 1..size-1 (at construction: they boot and load their shards
    while rank 0 loads its own for `group`), joins the group with them (`connect`), commands
    them, stops them. `group.check()` raises once a worker has died."""

    def __init__(self, *, size: int, device: torch.device, model_dir: Path | None,
                 model_config: ModelConfig, engine_config: EngineConfig,
                 dtype: torch.dtype) -> None:
        devices = _worker_devices(device, size)
        self.size = size
        self._closed = False
        self._failed_rank: int | None = None
        self._store = dist.TCPStore(STORE_HOST, 0, size, True, timeout=STORE_TIMEOUT,
                                    wait_for_workers=False)
        if device.type == "cuda":  # inherited by the workers; rank 0 shares their communicator
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        context = multiprocessing.get_context("spawn")
        self._processes: list[Any] = []
        self._pipes: list[multiprocessing.connection.Connection] = []
        self._messages: dict[int, str] = {}
        self._pipe_ended: set[int] = set()
        self.group = TPGroup(rank=0, size=size, device=devices[0])
        self.group.health_check = self.check
        try:
            for rank in range(1, size):
                receiver, sender = context.Pipe(duplex=False)
                process = context.Process(
                    target=worker_main, name=f"lmnb-tp-{rank}", daemon=True,
                    kwargs=dict(rank=rank, size=size, port=self._store.port,
                                device=str(devices[rank]), model_dir=model_dir,
                                model_config=model_config, engine_config=engine_config,
                                dtype=str(dtype).removeprefix("torch."), pipe=sender))
                process.start()
                sender.close()
                self._processes.append(process)
                self._pipes.append(receiver)
        except BaseException:
            self.close(graceful=False)
            raise

    def connect(self) -> None:
        """Waits until every worker has loaded its shard, then forms the group with them."""
        try:
            self._await_ready()
            self.group.join(self._store)
        except BaseException:
            self.close(graceful=False)
            raise

    # ---- health --------------------------------------------------------------------------------
    def _await_ready(self) -> None:
        """Until every worker says "ready" (it is about to join the group), or one dies."""
        pending = set(range(len(self._processes)))
        while pending:
            waitables = [self._pipes[i] for i in pending if i not in self._pipe_ended]
            waitables += [self._processes[i].sentinel for i in pending]
            multiprocessing.connection.wait(waitables)
            for i in list(pending):
                if self._read_pipe(i) == "ready":
                    pending.discard(i)
                elif not self._processes[i].is_alive():
                    self._failed_rank = i + 1
                    raise self._error(i)

    def _read_pipe(self, i: int) -> str | None:
        """The next message of worker i's pipe, if one is there ("ready" or "error", whose text
        is kept for the error rank 0 raises)."""
        if i in self._pipe_ended:
            return None
        pipe = self._pipes[i]
        try:
            if not pipe.poll():
                return None
            kind, text = pipe.recv()
        except (EOFError, OSError):
            self._pipe_ended.add(i)
            return None
        if kind == "error":
            self._messages[i] = text
        return kind

    def _error(self, i: int) -> TPError:
        self._read_pipe(i)
        process = self._processes[i]
        code = process.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else (
            f"exited with code {code}")
        message = self._messages.get(i)
        detail = f":\n{message}" if message else (
            " before it could say why (see its stderr; a script that starts a tensor-parallel "
            "Runtime needs `if __name__ == '__main__':` around it, as `spawn` re-imports it)"
            if code is not None and code > 0 else "")
        return TPError(f"tensor-parallel worker rank {i + 1} (pid {process.pid}) {how}{detail}")

    def check(self) -> None:
        """Raises `TPError` naming the first worker that is no longer running (while open)."""
        if self._closed:
            return
        for i, process in enumerate(self._processes):
            if not process.is_alive():
                if self._failed_rank is None:
                    self._failed_rank = i + 1
                    self.group.abort()
                raise self._error(i)

    # ---- commands ------------------------------------------------------------------------------
    def command(self, command: Command, arg: int = 0) -> None:
        self.check()
        self.group.steps.send_command(command, arg)

    def close(self, *, graceful: bool = True) -> None:
        """Stops every worker (STOP, else or with graceful=False terminate) and joins it;
        destroys the group."""
        if self._closed:
            return
        group = self.group
        stopped = False
        if (graceful and group.control is not None and group.failure is None
                and self._failed_rank is None):
            try:
                group.steps.send_command(Command.STOP)
                stopped = True
            except Exception:  # noqa: BLE001 - a dead peer: the others are terminated below
                pass
        self._closed = True
        for process in self._processes:
            process.join(JOIN_TIMEOUT_S if stopped else 0)
            if process.is_alive():
                process.terminate()
                process.join(10)
            if process.is_alive():
                process.kill()
                process.join()
        for pipe in self._pipes:
            pipe.close()
        group.destroy()
        self._store = None


def _exit_with_parent() -> None:
    """Ends this process as soon as the process that spawned it is gone (kernel restart, kill):
    a thread blocks on the parent's sentinel, which becomes ready when the parent dies."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(0)

    threading.Thread(target=watch, name="lmnb-tp-parent-watch", daemon=True).start()


def _inject_fault(rank: int, stage: str) -> None:
    if os.environ.get(FAULT_ENV) == f"{rank}:{stage}":
        raise RuntimeError(f"fault injected by {FAULT_ENV} at {stage}")


def worker_main(*, rank: int, size: int, port: int, device: str, model_dir: Path | None,
                model_config: ModelConfig, engine_config: EngineConfig, dtype: str,
                pipe: multiprocessing.connection.Connection) -> None:
    """Entry point of tensor-parallel rank `rank` (spawned): joins, loads its shard, serves."""
    _exit_with_parent()
    try:
        torch_device = torch.device(device)
        if torch_device.type == "cuda":
            torch.cuda.set_device(torch_device)
        else:  # share the cores with the other ranks
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        tp = TPGroup(rank=rank, size=size, device=torch_device)
        model = _load(tp, model_dir=model_dir, model_config=model_config,
                      engine_config=engine_config, dtype=getattr(torch, dtype))
        pipe.send(("ready", ""))
        tp.join(dist.TCPStore(STORE_HOST, port, size, False, timeout=STORE_TIMEOUT))
        _serve(tp, model, model_config=model_config, engine_config=engine_config,
               dtype=getattr(torch, dtype))
        if torch_device.type == "cpu":
            tp.destroy()  # NCCL: the process's exit frees the communicator, waiting for no one
    except BaseException:
        try:
            pipe.send(("error", traceback.format_exc()))
        finally:
            os._exit(1)
    os._exit(0)  # stopped: nothing to clean up that the OS does not (interpreter exit is slow)


def _load(tp: TPGroup, *, model_dir: Path | None, model_config: ModelConfig,
          engine_config: EngineConfig, dtype: torch.dtype) -> torch.nn.Module:
    from lmnb.runtime.models import loader
    from lmnb.runtime.models.layers.fusion import fused_kernels_available, set_fused_kernels

    _inject_fault(tp.rank, "load")
    model = loader.load_model(model_dir, model_config, dtype=dtype, device=tp.device,
                              dummy=engine_config.load_format == "dummy", tp=tp)
    if not engine_config.disable_fused_kernels and fused_kernels_available(tp.device):
        set_fused_kernels(model, True)  # as rank 0 decides (the Runtime)
    return model


def _serve(tp: TPGroup, model: torch.nn.Module, *, model_config: ModelConfig,
           engine_config: EngineConfig, dtype: torch.dtype) -> None:
    from lmnb.runtime.model_runner import ModelRunner

    runner: ModelRunner | None = None
    while True:
        command, arg, step = tp.steps.receive()
        if command is Command.STOP:
            if runner is not None:
                runner.release_graphs()
            return
        if command is Command.RUNNER:
            runner = ModelRunner(model, model_config, engine_config, device=tp.device,
                                 dtype=dtype, eos_token_ids=set(), tp=tp)
        elif command is Command.CAPTURE:
            assert runner is not None
            runner.capture_cuda_graphs(arg)
        else:
            assert runner is not None and step is not None
            runner.follow(step)
