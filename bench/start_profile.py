"""Where an engine's start goes: a sampling profiler over every thread while `Runtime()` is built.

cProfile sees one thread and mis-charges time spent under torch's C++ dispatch; the runtime builds
its model, captures CUDA graphs and compiles Triton kernels on several threads. This samples every
thread's Python stack (`sys._current_frames`) every `--interval` seconds and reports:

- the seconds of imports, of the constructor, and the constructor's own phases (the innermost
  `lmnb` frame of the sampled stacks, bucketed by time: which part of lmnb was running when);
- inclusive seconds per function (a function counts once per sample if it is on the stack), for
  lmnb's functions and for everything else, so that compiles, imports and waits show up by name.

    python bench/start_profile.py --device cuda --tokenizer .gpu/tokenizer-llama3     # Llama-3-8B
    python bench/start_profile.py --device cpu --dummy-config tiny --tokenizer <folder>
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

_PROCESS_T0 = time.perf_counter()

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS_DIR  # noqa: E402

LMNB_MARK = "/lmnb/"


def frame_name(frame: FrameType) -> str:
    code = frame.f_code
    path = code.co_filename
    short = path.split(LMNB_MARK, 1)[1] if LMNB_MARK in path else "/".join(path.split("/")[-2:])
    prefix = "lmnb/" if LMNB_MARK in path else ""
    return f"{prefix}{short}:{code.co_name}"


@dataclass
class StackSampler:
    """Samples every other thread's stack every `interval` seconds until `stop()`."""

    interval: float
    inclusive: Counter[str] = field(default_factory=Counter)  # seconds
    innermost_lmnb: list[tuple[float, str]] = field(default_factory=list)
    samples: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        own = threading.get_ident()
        last = time.perf_counter() - _PROCESS_T0
        while not self._stop.wait(self.interval):
            now = time.perf_counter() - _PROCESS_T0
            weight, last = now - last, now  # the sampler waits for the GIL too: real seconds
            self.samples += 1
            for ident, frame in sys._current_frames().items():
                if ident == own:
                    continue
                names, lmnb_leaf = self._walk(frame)
                if len(names) <= 2:  # an idle thread parked in a wait
                    continue
                for name in set(names):
                    self.inclusive[name] += weight
                if lmnb_leaf is not None:
                    self.innermost_lmnb.append((now, lmnb_leaf))

    @staticmethod
    def _walk(frame: FrameType | None) -> tuple[list[str], str | None]:
        names: list[str] = []
        lmnb_leaf = None
        while frame is not None:
            name = frame_name(frame)
            names.append(name)
            if lmnb_leaf is None and name.startswith("lmnb/"):
                lmnb_leaf = name
            frame = frame.f_back
        return names, lmnb_leaf


def phases(points: list[tuple[float, str]], bucket: float) -> list[tuple[float, str, int]]:
    """(bucket start s, most frequent innermost lmnb frame, its samples) per time bucket."""
    buckets: dict[int, Counter[str]] = {}
    for at, name in points:
        buckets.setdefault(int(at / bucket), Counter())[name] += 1
    return [(index * bucket, *counts.most_common(1)[0])
            for index, counts in sorted(buckets.items())]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dummy-config", default="llama-3-8b")
    parser.add_argument("--tokenizer", required=True, help="HF tokenizer folder")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--interval", type=float, default=0.01)
    parser.add_argument("--bucket", type=float, default=1.0, help="phase table's time step, s")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--json-out", type=Path, default=RESULTS_DIR / "start_profile.json")
    args = parser.parse_args(argv)

    sampler = StackSampler(args.interval)
    sampler.start()
    import torch  # noqa: F401  (timed as part of the imports)

    from bench.dummy_models import write_self_contained_dummy_model
    from lmnb.runtime.engine import Runtime

    imported = time.perf_counter() - _PROCESS_T0
    folder = write_self_contained_dummy_model(args.dummy_config, tempfile.mkdtemp(),
                                              args.tokenizer).path
    began = time.perf_counter() - _PROCESS_T0
    runtime = Runtime(folder, load_format="dummy", dtype=args.dtype, device=args.device,
                      attention_backend=args.backend)
    ready = time.perf_counter() - _PROCESS_T0
    sampler.stop()
    capture = runtime.stats().get("cuda_graph_capture_seconds")
    runtime.close()

    print(f"imports {imported:.1f} s, constructor {ready - began:.1f} s (graph capture "
          f"{capture}), ready {ready:.1f} s after the interpreter started; "
          f"{sampler.samples} samples every {args.interval * 1000:.0f} ms")
    print("\nphases (innermost lmnb frame, per bucket):")
    for at, name, count in phases(sampler.innermost_lmnb, args.bucket):
        print(f"  {at:7.1f} s  {name}  ({count})")
    ranked = sampler.inclusive.most_common()
    lmnb_rows = [(n, s) for n, s in ranked if n.startswith("lmnb/")][:args.top]
    other_rows = [(n, s) for n, s in ranked if not n.startswith("lmnb/")][:args.top]
    for title, rows in (("lmnb functions", lmnb_rows), ("other functions", other_rows)):
        print(f"\n{title}, inclusive seconds (summed over threads):")
        for name, seconds in rows:
            print(f"  {seconds:7.2f}  {name}")
    result = {"imports_s": imported, "constructor_s": ready - began, "ready_s": ready,
              "graph_capture_s": capture, "lmnb": lmnb_rows, "other": other_rows,
              "phases": phases(sampler.innermost_lmnb, args.bucket)}
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
