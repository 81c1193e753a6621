"""The output thread's cost per token event, on the calling thread (`OutputProcessor.pump`).

The output thread shares the GIL with the scheduler thread: every microsecond it spends on a
token event is taken from the thread that launches the GPU passes (a decode step of batch 256
emits 256 events). R requests (prompts of 8 random ids, seed 0) each get one token per step
for S steps, the last step finishing them; the time per event is reported for whole streams
(one chunk per request at its end) and incremental ones (a chunk per event), for each tokenizer,
fastest of `--repeats` runs. Chunks are left in their streams (no consumer runs), as a consumer
on another thread would take them.

The runtime `gc.freeze()`s its start-up heap (`engine.py`, as vLLM does), so this does too once
the tokenizers are loaded; `--no-freeze` shows what full collections over the import-time heap
cost (the first measured configuration pays most of them).

    python bench/output_thread.py --tokenizers .gpu/tokenizer-llama3 .gpu/tokenizer
    python bench/output_thread.py --profile      # a cProfile of one run per configuration
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO_ROOT, RESULTS_DIR, environment, format_table, write_json  # noqa: E402
from lmnb.runtime.models import loader  # noqa: E402
from lmnb.runtime.output.events import TokenEvent  # noqa: E402
from lmnb.runtime.output.processor import OutputProcessor  # noqa: E402
from lmnb.runtime.output.stream import OutputStream  # noqa: E402

SEED = 0
DEFAULT_TOKENIZERS = (REPO_ROOT / ".gpu" / "tokenizer-llama3", REPO_ROOT / ".gpu" / "tokenizer")


def _run(tokenizer: Any, *, incremental: bool, requests: int, steps: int,
         profile: cProfile.Profile | None = None) -> float:
    """Seconds per event of one run (registration and event building not timed)."""
    rng = random.Random(SEED)
    processor = OutputProcessor()
    stream = OutputStream(list(range(requests)), incremental=incremental)
    processor.register_many([
        processor.registration(stream, rid, tokenizer=tokenizer,
                               prompt_ids=[rng.randrange(10000) for _ in range(8)])
        for rid in range(requests)])
    processor.pump()
    events = [[TokenEvent(rid, [rng.randrange(10000)],
                          {"type": "length", "length": steps} if step == steps - 1 else None)
               for rid in range(requests)] for step in range(steps)]
    if profile is not None:
        profile.enable()
    start = time.perf_counter()
    for step_events in events:
        processor.put(step_events)
        processor.pump()
    seconds = time.perf_counter() - start
    if profile is not None:
        profile.disable()
    assert stream.finished
    return seconds / (requests * steps)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizers", nargs="+", type=Path, default=None,
                        help="tokenizer folders (default: .gpu/tokenizer-llama3 and "
                             ".gpu/tokenizer where present, else the embedded SmolLM2's)")
    parser.add_argument("--requests", type=int, default=256, help="events per step")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="runs each; fastest counts")
    parser.add_argument("--no-freeze", action="store_true",
                        help="leave the start-up heap to the collector (the runtime freezes it)")
    parser.add_argument("--profile", action="store_true",
                        help="print a cProfile of one more run per configuration")
    parser.add_argument("--top", type=int, default=15, help="rows of each profile table")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "output_thread.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    folders = args.tokenizers or [p for p in DEFAULT_TOKENIZERS if p.is_dir()] or [
        loader.resolve_model_dir(None)]
    tokenizers = {folder.name: loader.load_tokenizer(folder) for folder in folders}
    if not args.no_freeze:
        gc.collect()
        gc.freeze()
    rows, results = [], []
    for name, tokenizer in tokenizers.items():
        for incremental in (False, True):
            times = [_run(tokenizer, incremental=incremental, requests=args.requests,
                          steps=args.steps) for _ in range(args.repeats)]
            mode = "incremental" if incremental else "whole"
            result = {"tokenizer": name, "stream": mode, "us_per_event": min(times) * 1e6,
                      "median_us_per_event": statistics.median(times) * 1e6}
            results.append(result)
            rows.append([name, mode, result["us_per_event"], result["median_us_per_event"]])
            if args.profile:
                profile = cProfile.Profile()
                _run(tokenizer, incremental=incremental, requests=args.requests,
                     steps=args.steps, profile=profile)
                text = io.StringIO()
                pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.top)
                print(f"--- {name} {mode}\n{text.getvalue()}")
    print(format_table(["tokenizer", "stream", "us/event", "median"], rows))
    payload = {"environment": environment("cpu"), "requests": args.requests,
               "steps": args.steps, "repeats": args.repeats, "gc_frozen": not args.no_freeze,
               "results": results}
    print(f"wrote {write_json(args.output, payload)}")
    return payload


if __name__ == "__main__":
    main()
