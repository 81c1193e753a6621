"""Helpers shared by the benchmark scripts: wall-clock timing, one results table, JSON output."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "bench" / "results"


def synchronize(device: str | torch.device) -> None:
    """Waits for queued GPU work, so that wall-clock times cover it."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def stopwatch(device: str | torch.device) -> Iterator[dict[str, float]]:
    """`with stopwatch(dev) as t: ...` then `t["seconds"]`; synchronizes the device at both ends."""
    timing = {"seconds": 0.0}
    synchronize(device)
    start = time.perf_counter()
    try:
        yield timing
    finally:
        synchronize(device)
        timing["seconds"] = time.perf_counter() - start


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def device_name(device: str | torch.device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    return f"CPU {cpu} ({torch.get_num_threads()} torch threads, {os.cpu_count()} cores)"


def _git_commit() -> str | None:
    try:
        result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                                capture_output=True, text=True, timeout=5, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() or None


def environment(device: str | torch.device) -> dict[str, Any]:
    """What a result was measured on: device, library versions, commit, time."""
    import transformers

    return {
        "device": str(device),
        "device_name": device_name(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "git_commit": _git_commit(),
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def format_cell(value: Any) -> str:
    """A table cell: None is '-', floats get 2 decimals, ints thousands separators."""
    if isinstance(value, bool) or value is None:
        return "-" if value is None else str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.2f}"
    return str(value)


def format_markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """The same cells as `format_table`, as a GitHub markdown table (numbers right-aligned)."""
    cells = [[format_cell(v).replace("|", "\\|") for v in row] for row in rows]
    align = ["---" if i == 0 else "---:" for i in range(len(headers))]
    return "\n".join("| " + " | ".join(line) + " |" for line in [list(headers), align, *cells])


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table; floats get 2 decimals, ints thousands separators."""
    cells = [[format_cell(v) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    # First column left-aligned (names), the rest right-aligned (numbers).
    def line(values: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w)
                         for i, (v, w) in enumerate(zip(values, widths, strict=True)))

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in cells)])


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    """Writes `payload` as indented JSON, creating the folder; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def write_results(path: str | Path, payload: dict[str, Any]) -> Path:
    """`write_json`, and a copy in $OUT when that is set (the device machine's folder that comes
    back) and `path` is not already there; returns `path`."""
    path = write_json(path, payload)
    if (out := os.environ.get("OUT")) and (Path(out) / path.name).resolve() != path.resolve():
        write_json(Path(out) / path.name, payload)
    return path


def graph_seconds_per_call(call: Callable[[int], object], *, calls: int, replays: int) -> float:
    """Seconds per call of `call(i)`, i = 0..calls-1, captured in one CUDA graph and replayed
    `replays` times (best of 3 timings). `call` must already be compiled / warmed up."""
    import math

    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for i in range(calls):
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / (replays * calls))
    del graph
    return best
