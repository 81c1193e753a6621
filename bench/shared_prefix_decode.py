"""Shared-prefix decode on vs off (`disable_shared_prefix_decode`), one Runtime per setting, on
the prefix-sharing workloads of issue 19 sent as token ids:

  shared-prefix  8 prefixes of 1,500 tokens x 32 questions of 40 tokens, 16 new tokens
  fork-heavy     64 documents of 600 tokens x 4 questions of 32 tokens, 64 new tokens

Each timed run starts from an empty cache (after one untimed warm-up); greedy, ignore_eos.

    python bench/shared_prefix_decode.py --dummy-config llama-3-8b --tokenizer .gpu/tokenizer
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    RESULTS_DIR,
    environment,
    format_table,
    resolve_device,
    stopwatch,
    write_json,
)
from bench.dummy_models import DUMMY_CONFIGS, write_dummy_model  # noqa: E402

WORKLOADS = {  # name: (groups, prefix tokens, members, question tokens, new tokens)
    "shared-prefix": (8, 1500, 32, 40, 16),
    "fork-heavy": (64, 600, 4, 32, 64),
}


def prompts(name: str, vocab: int, scale: float) -> tuple[list[list[int]], int]:
    groups, prefix, members, question, new = WORKLOADS[name]
    rng = random.Random(0)
    prefix = max(int(prefix * scale), 2)
    ids = [[rng.randrange(1000, vocab - 1) for _ in range(prefix)] for _ in range(groups)]
    out = [p + [rng.randrange(1000, vocab - 1) for _ in range(question)] for p in ids
           for _ in range(members)]
    rng.shuffle(out)
    return out, new


def profiled(rt: Any, ids: list[list[int]], params: dict[str, Any], label: str) -> None:
    """One more run under torch.profiler: kernel time by category, busy vs wall, top kernels."""
    from torch.profiler import ProfilerActivity, profile

    from bench.kernel_profile import CATEGORY_HEADERS, category_rows, device_events, summarize

    passes = []
    rt.set_batch_hook(lambda batch: passes.append(batch.mode.name))
    rt.flush_cache()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with stopwatch(rt.device) as t:
            rt.generate(input_ids=ids, sampling_params=params)
    rt.set_batch_hook(None)
    summary = summarize(device_events(prof), wall_seconds=t["seconds"], passes=len(passes),
                        top=12)
    print(f"\n{label}: wall {t['seconds']:.3f} s, busy {summary['busy_seconds']:.3f} s, "
          f"passes {passes.count('EXTEND')} extend + {passes.count('DECODE')} decode")
    print(format_table(CATEGORY_HEADERS, category_rows(summary)))
    for kernel in summary["top_kernels"]:
        print(f"  {1e3 * kernel['seconds']:8.1f} ms {kernel['count']:6d}x  {kernel['name'][:90]}")


def run(model_dir: Path, options: dict[str, Any], *, disabled: bool, workloads: list[str],
        repeats: int, vocab: int, scale: float, profile: bool = False) -> dict[str, float]:
    import lmnb

    times: dict[str, float] = {}
    with lmnb.Runtime(model_dir, disable_shared_prefix_decode=disabled, **options) as rt:
        for name in workloads:
            ids, new = prompts(name, vocab, scale)
            params = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
            samples = []
            for attempt in range(repeats + 1):
                rt.flush_cache()
                with stopwatch(rt.device) as t:
                    rt.generate(input_ids=ids, sampling_params=params)
                if attempt:
                    samples.append(t["seconds"])
            times[name] = statistics.median(samples)
            if profile:
                profiled(rt, ids, params, f"{name}, shared-prefix decode "
                                          f"{'off' if disabled else 'on'}")
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dummy-config", choices=sorted(DUMMY_CONFIGS), default="llama-3-8b")
    parser.add_argument("--model", default=None, help="a model folder instead of random weights")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--attention-backend", default="triton")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0, help="prefix lengths x this")
    parser.add_argument("--profile", action="store_true",
                        help="one more run of each under torch.profiler, summarised")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "shared_prefix_decode.json")
    args = parser.parse_args(argv)
    workloads = args.workloads.split(",")
    options: dict[str, Any] = {"attention_backend": args.attention_backend,
                               "device": args.device}
    with tempfile.TemporaryDirectory() as scratch:
        if args.model:
            model_dir, vocab = Path(args.model), 32000
        else:
            dummy = write_dummy_model(args.dummy_config, scratch, args.tokenizer)
            model_dir, vocab = dummy.path, dummy.fields["vocab_size"]
            options.update(dummy.runtime_options())
        on = run(model_dir, options, disabled=False, workloads=workloads, repeats=args.repeats,
                 vocab=vocab, scale=args.scale, profile=args.profile)
        off = run(model_dir, options, disabled=True, workloads=workloads, repeats=args.repeats,
                  vocab=vocab, scale=args.scale, profile=args.profile)
    rows = [[name, off[name], on[name], off[name] / on[name]] for name in workloads]
    print(format_table(["workload", "plain decode s", "shared-prefix decode s", "speed-up"], rows))
    write_json(args.output, {"environment": environment(resolve_device(args.device)),
                             "args": {k: str(v) for k, v in vars(args).items()},
                             "rows": [dict(zip(["workload", "off_s", "on_s", "speedup"], r,
                                               strict=True)) for r in rows]})


if __name__ == "__main__":
    main()
