"""One sampling step at the offline workload's decode shape: [234, 128256] logits (random
Llama-3-8B's vocabulary) as the model returns them, bf16, through `Sampler` on the GPU.

Per case (rows at temperature 0.6 as in bench/offline.py; greedy; temperature with min-p; top-p;
top-k; top-k with top-p; the first with top-5 logprobs) and logits dtype: milliseconds per step
issued and waited for as the runtime does (one `synchronize` per step), the device time per step
(the sum of the kernels the torch profiler sees) and the kernels per step by name. `--upcast`
adds each case with the logits copied to fp32 first, in the step (what `compute_logits` returned
before it kept the model's dtype): its extra device time is the copy. The cases use only
`Sampler`'s public API, so a checkout of an older commit runs them too (copy the file there, without
`--sweep`) for a before/after.

`--sweep` times `race.sample_rows` alone (the one read of every row: draws, greedy ids,
verdicts) over its block, warps and slices per row, device microseconds per call by CUDA events,
beside a bare read of the logits (`amax`) for the bandwidth floor, and `thresholds.cut_floors`
alone (top-p 0.9, top-k 50, both: the radix-select passes before the race) over its block, warps
and slices per row (and the default without skipping the blocks that hold no token under a
pass's prefix), with the rows whose floor differs from the default setting's (top-k: must be
none; top-p: float sums in another order, none but at a nucleus edge within rounding of top_p).
`--sweep floors` (or `race`) runs only that half of the sweep and skips the cases.

    python bench/sampler_step.py --upcast                 # bf16 and fp32-copy rows
    python bench/sampler_step.py --sweep                  # the kernels' launch settings
    python bench/sampler_step.py --sweep floors           # cut_floors' settings only
    python bench/sampler_step.py --batch 64 --steps 100
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS_DIR, environment, format_table, write_json  # noqa: E402
from lmnb.runtime.core import Req, SamplingParams  # noqa: E402
from lmnb.runtime.sampling import Sampler  # noqa: E402
from lmnb.runtime.scheduler import ReqState  # noqa: E402

CASES: dict[str, dict[str, Any]] = {
    "t0.6": {"temperature": 0.6},
    "greedy": {"temperature": 0.0},
    "t0.6 min_p 0.05": {"temperature": 0.6, "min_p": 0.05},
    "t0.6 top_p 0.9": {"temperature": 0.6, "top_p": 0.9},
    "t0.6 top_k 50": {"temperature": 0.6, "top_k": 50},
    "t0.6 top_k 50 top_p 0.9": {"temperature": 0.6, "top_k": 50, "top_p": 0.9},
}
LOGPROB_CASE = "t0.6 top5 logprobs"


def _rows(batch: int, params: dict[str, Any], top: int) -> list[ReqState]:
    return [ReqState(Req(origin_input_ids=[1, 2, 3], sampling_params=SamplingParams(**params),
                         return_logprob=top > 0, top_logprobs_num=top)) for _ in range(batch)]


def _kernels_per_step(step: Callable[[], Any], steps: int) -> tuple[float, list[tuple[str, float]]]:
    """(device microseconds per step, [(kernel, microseconds per step)] by time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per_name: Counter[str] = Counter()
    for event in prof.events():
        if event.device_type.name == "CUDA":
            per_name[event.name] += (event.time_range.end - event.time_range.start) / steps
    return sum(per_name.values()), per_name.most_common()


def measure(sampler: Sampler, logits: torch.Tensor, rows: list[ReqState], *, upcast: bool,
            steps: int) -> dict[str, Any]:
    info = sampler.batch_info(rows, logits.device)

    def step() -> None:
        sampler(logits.float() if upcast else logits, info).synchronize()

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    wall_ms = 1e3 * (time.perf_counter() - start) / steps
    device_us, kernels = _kernels_per_step(step, steps)
    return {"wall_ms": wall_ms, "device_us": device_us, "kernels_per_step": len(kernels),
            "kernels": [{"name": name, "us": us} for name, us in kernels]}


def _device_us(call: Callable[[], Any], steps: int) -> float:
    for _ in range(3):
        call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        call()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / steps


def sweep(logits: torch.Tensor, steps: int) -> list[dict[str, Any]]:
    """`race.sample_rows` over every row at temperature 0.6, per launch setting; the reference
    setting's ids must not change with the others (the draw does not depend on them)."""
    from lmnb.runtime.sampling import race

    n = logits.shape[0]
    rows = torch.arange(n, device="cuda")
    temps = torch.full((n,), 0.6, device="cuda")
    floors = torch.full((n,), float("-inf"), device="cuda")
    seeds = torch.randint(race.SEED_BOUND, (n,), device="cuda")
    reference = race.sample_rows(logits, rows, temps, floors, seeds)
    out = [{"setting": "sample_rows default", "us": _device_us(
        lambda: race.sample_rows(logits, rows, temps, floors, seeds), steps)}]
    for block in (1024, 2048, 4096):
        for warps in (4, 8):
            for splits in (1, 2, 4, 8, 16):
                def call(block: int = block, warps: int = warps, splits: int = splits) -> Any:
                    return race.sample_rows(logits, rows, temps, floors, seeds, splits=splits,
                                            block=block, warps=warps)

                assert torch.equal(call(), reference), (block, warps, splits)
                out.append({"setting": f"sample_rows block {block} warps {warps} splits {splits}",
                            "us": _device_us(call, steps)})
    return out


def floors_sweep(logits: torch.Tensor, steps: int) -> list[dict[str, Any]]:
    """`thresholds.cut_floors` over every row (T 0.6) per filter and launch setting (block, warps,
    slices per row), with the rows whose floor differs from the default setting's: none for
    top-k (exact counts); top-p's float sums are reordered, so a differing row is reported, not
    fatal."""
    from lmnb.runtime.sampling import thresholds
    from lmnb.runtime.sampling.batch_info import RowGroup

    n, vocab = logits.shape
    out = []
    for name, params in (("top_p 0.9", {"top_p": 0.9}), ("top_k 50", {"top_k": 50}),
                         ("top_k 50 top_p 0.9", {"top_k": 50, "top_p": 0.9})):
        group = RowGroup(list(range(n)), [SamplingParams(temperature=0.6, **params)] * n, vocab,
                         n, torch.device("cuda"))
        reference = thresholds.cut_floors(logits, group)
        out.append({"setting": f"cut_floors {name}: default (block {thresholds.BLOCK} warps "
                               f"{thresholds.WARPS} splits "
                               f"{thresholds.floor_slices(n, vocab)})",
                    "us": _device_us(lambda group=group: thresholds.cut_floors(logits, group),
                                     steps), "differing": 0})

        def unskipped(group: RowGroup = group) -> Any:
            return thresholds.cut_floors(logits, group, skip=False)

        differing = int((unskipped() != reference).sum())
        assert differing == 0, name  # skipped blocks add zeros: the very same sums
        out.append({"setting": f"cut_floors {name}: default, no block skipping",
                    "us": _device_us(unskipped, steps), "differing": differing})
        for block in (256, 512, 1024):
            for warps in (4, 8):
                for splits in (1, 4, 8, 16, 32):
                    def call(block: int = block, warps: int = warps, splits: int = splits,
                             group: RowGroup = group) -> Any:
                        return thresholds.cut_floors(logits, group, block=block, warps=warps,
                                                     splits=splits)

                    differing = int((call() != reference).sum())
                    assert differing == 0 or "top_p" in name, (name, block, warps, splits)
                    out.append({"setting": f"cut_floors {name}: block {block} warps {warps} "
                                           f"splits {splits}",
                                "us": _device_us(call, steps), "differing": differing})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=234)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--upcast", action="store_true",
                        help="also each case with the logits copied to fp32 in the step")
    parser.add_argument("--top-kernels", type=int, default=6)
    parser.add_argument("--sweep", nargs="?", const="all", choices=("all", "race", "floors"),
                        help="the kernels alone over their launch settings (race / floors: only "
                             "that kernel's, without the cases)")
    parser.add_argument("--out", default=str(RESULTS_DIR / "sampler_step.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    torch.manual_seed(0)
    sampler = Sampler(args.vocab, {2})
    logits = (torch.randn(args.batch, args.vocab, device="cuda") * 3).bfloat16()
    cases = [(name, params, 0) for name, params in CASES.items()]
    cases.append((LOGPROB_CASE, CASES["t0.6"], 5))
    results, table = [], []
    for name, params, top in cases if args.sweep in (None, "all") else []:
        for upcast in (False, True) if args.upcast else (False,):
            got = measure(sampler, logits, _rows(args.batch, params, top), upcast=upcast,
                          steps=args.steps)
            got.update(case=name, logits="fp32 copy" if upcast else "bf16")
            results.append(got)
            table.append([name, got["logits"], got["wall_ms"], got["device_us"],
                          got["kernels_per_step"]])
            print(f"{name} ({got['logits']}): " + ", ".join(
                f"{k['name'][:48]} {k['us']:.1f} us" for k in got["kernels"][:args.top_kernels]),
                flush=True)
    print(f"\nbatch {args.batch}, vocabulary {args.vocab:,}, {args.steps} steps per case")
    if table:
        print(format_table(["case", "logits", "ms/step (wall)", "device us/step",
                            "kernels/step"], table))
    settings = []
    if args.sweep:
        settings.append({"setting": "amax (a bare read)",
                         "us": _device_us(lambda: logits.amax(dim=-1), args.steps)})
    if args.sweep in ("all", "race"):
        settings.extend(sweep(logits, args.steps))
    if args.sweep in ("all", "floors"):
        settings.extend(floors_sweep(logits, args.steps))
    if settings:
        print(format_table(["kernel alone, bf16, T 0.6", "device us/call", "rows differing"],
                           [[row["setting"], row["us"], row.get("differing")]
                            for row in settings]))
    path = write_json(args.out, {"environment": environment("cuda"), "args": vars(args),
                                 "results": results, "sweep": settings})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
