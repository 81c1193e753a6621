"""What bounds speculative decoding on a GPU: the cost of a verify pass of k draft tokens against a
decode step (batch 1), and batch-64 throughput with NGRAM speculation on vs off (it must turn
itself off there: >= 0.97x).

Random weights of a real architecture (`--dummy-config`, default Llama-3-8B bf16). A Runtime
without speculation gives the batch-1 decode step ((t(N) - t(1)) / (N - 1)). For each k, a Runtime
with `speculative_algorithm="NGRAM"`, `speculative_num_draft_tokens=k+1` and the deterministic
draft policy generates the same greedy request twice: the second run drafts the first run's output
from the corpus of recent requests, so every verify pass carries k drafts; the runtime's own pass
timings (`stats()["speculative"]["seconds"]`) give the verify pass. Each k runs in every
`--verify-modes`: "auto" (graphed: the verify pass as k + 1 decode rows replaying a decode CUDA
graph; the runtime counts the passes that did) and "extend" (eager: one EXTEND forward). Reported:
verify / decode, the accepted length (below k + 1 only where verify and decode logits differ in the
last bits), and the speedups these give (tokens per pass over the pass's cost in decode steps).
A verify pass runs synchronously (nothing overlaps its host work) while decode steps overlap the
next step's host work. The batch-1 runtimes capture decode graphs up to the widest verify pass
(`cuda_graph_max_bs` = max k + 1, `speculative_max_batch_size` 1: quick to build).
`--batch 0` skips the batch run. The batch's throughput:
fresh Runtimes without and with NGRAM configured, alternated `--batch-repeats` times with the same
warm-up (best of each), with the passes each ran and how many the overlap schedule launched ahead.

    python bench/speculative_cost.py --device cuda                     # Llama-3-8B, H100
    python bench/speculative_cost.py --device cuda --ks 2 4 8 16 --batch 0   # the k table only
    python bench/speculative_cost.py --dummy-config smollm2-135m --ks 2 4 --batch 4 \\
        --max-new-tokens 24 --device cpu                                 # a CPU smoke run
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
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


def _prompt_ids(n: int, seed: int, vocab: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, min(vocab, 32000)) for _ in range(n)]


def _params(max_new_tokens: int) -> dict[str, Any]:
    return {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}


def _timed(rt: Any, prompts: list[list[int]], max_new_tokens: int) -> tuple[float, int]:
    """(seconds, completion tokens) of one generate call over `prompts`."""
    with stopwatch(rt.device) as timing:
        outs = rt.generate(input_ids=prompts, sampling_params=_params(max_new_tokens))
    return timing["seconds"], sum(o["meta_info"]["completion_tokens"] for o in outs)


def baseline(model: str, options: dict[str, Any], prompts: list[list[int]],
             max_new_tokens: int, widths: list[int]) -> dict[str, Any]:
    """Without speculation: the decode step ((t(N) - t(1)) / (N - 1): prefill and start-up
    cancel) at batch 1, and at each batch of `widths` (as many rows as a verify pass of k drafts
    has, k + 1: the same decode graph a graphed verify pass replays, its GPU time without the
    verify pass's host work)."""
    from lmnb.runtime.engine import Runtime

    steps: dict[int, float] = {}
    with Runtime(model, **options) as rt:
        _timed(rt, [prompts[0][:16]], 8)  # warm-up
        for width in sorted({1, *widths}):
            rt.flush_cache()
            one, _ = _timed(rt, prompts[:width], 1)
            many, _ = _timed(rt, prompts[:width], max_new_tokens)
            steps[width] = 1000 * (many - one) / (max_new_tokens - 1)
    return {"decode_ms": steps[1], "decode_ms_at_batch": steps}


def verify_cost(model: str, options: dict[str, Any], k: int, prompt: list[int],
                max_new_tokens: int, decode_ms: float, verify_mode: str = "auto"
                ) -> dict[str, Any]:
    """The verify pass of k drafts: the request again after a first run, its drafts from the
    first run's output (the corpus of recent requests), so every pass carries k drafts."""
    from lmnb.runtime.engine import Runtime

    with Runtime(model, **options, speculative_algorithm="NGRAM",
                 speculative_num_draft_tokens=k + 1, speculative_draft_policy="always",
                 speculative_min_accept_rate=0.0, speculative_verify_mode=verify_mode,
                 speculative_max_batch_size=1) as rt:
        _timed(rt, [prompt[:16]], 8)  # warm-up
        rt.flush_cache()
        _timed(rt, [prompt], max_new_tokens)
        stats_before = rt.stats()
        before = stats_before["speculative"]
        with stopwatch(rt.device):
            out = rt.generate(input_ids=prompt, sampling_params=_params(max_new_tokens))
        stats_after = rt.stats()
        after = stats_after["speculative"]
    passes = after["timed_passes"]["verify"] - before["timed_passes"]["verify"]
    replayed = stats_after["verify_graph_replays"] - stats_before["verify_graph_replays"]
    verify_ms = 1000 * (after["seconds"]["verify"] - before["seconds"]["verify"]) / max(passes, 1)
    accept_length = out["meta_info"].get("spec_accept_length", 0.0)
    return {"k": k, "verify_mode": verify_mode, "graph_replays": replayed,
            "verify_ms": verify_ms, "verify_over_decode": verify_ms / decode_ms,
            "accept_length": accept_length, "verify_passes": passes,
            # tokens per pass over the pass's cost in decode steps: what drafts this good buy
            "speedup_at_this_acceptance": accept_length * decode_ms / verify_ms,
            "speedup_if_all_accepted": (k + 1) * decode_ms / verify_ms}


def batch_throughput(model: str, options: dict[str, Any], batch: list[list[int]],
                     max_new_tokens: int, *, speculative: bool) -> dict[str, Any]:
    """The batch's throughput in a fresh Runtime, with or without NGRAM configured, the same
    warm-up either way; the passes it ran and how many the overlap schedule launched ahead (at
    a batch over `speculative_max_batch_size` both runtimes should run the same passes)."""
    import gc

    import torch

    from lmnb.runtime.engine import Runtime

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    extra = {"speculative_algorithm": "NGRAM"} if speculative else {}
    with Runtime(model, **options, **extra) as rt:
        _timed(rt, batch[:2], 8)
        rt.flush_cache()
        before = rt.stats()
        seconds, tokens = _timed(rt, batch, max_new_tokens)
        after = rt.stats()
    return {"batch_tok_s": tokens / seconds, "seconds": seconds,
            "forward_passes": after["forward_passes"] - before["forward_passes"],
            "overlapped_passes": after["overlapped_passes"] - before["overlapped_passes"],
            "speculative": after["speculative"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dummy-config", default="llama-3-8b", choices=sorted(DUMMY_CONFIGS))
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer folder (default: the embedded SmolLM2's)")
    parser.add_argument("--ks", type=int, nargs="*", default=[2, 4, 8, 12, 16])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--verify-modes", nargs="*", default=["auto", "extend"],
                        choices=["auto", "decode", "extend"],
                        help="auto: graphed decode rows; extend: one eager EXTEND")
    parser.add_argument("--batch", type=int, default=64, help="0: no batch run")
    parser.add_argument("--batch-repeats", type=int, default=2,
                        help="off/on runtimes alternated this many times (best of each)")
    parser.add_argument("--out", default=str(RESULTS_DIR / "speculative_cost.json"))
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    with tempfile.TemporaryDirectory() as scratch:
        dummy = write_dummy_model(args.dummy_config, scratch, args.tokenizer)
        options = {"device": str(device), **dummy.runtime_options(),
                   "max_total_tokens": max(16384, args.batch * (args.prompt_len
                                                                + args.max_new_tokens + 32))}
        vocab = dummy.fields["vocab_size"]
        prompt = _prompt_ids(args.prompt_len, 0, vocab)
        batch = [_prompt_ids(args.prompt_len, seed, vocab) for seed in range(1, args.batch + 1)]
        model = str(dummy.path)
        widths = [k + 1 for k in args.ks]
        others = [_prompt_ids(args.prompt_len, 1000 + seed, vocab)
                  for seed in range(max(widths, default=1) - 1)]
        # batch-1 runtimes: decode graphs up to the widest verify pass (fast to capture)
        table_options = {**options, "cuda_graph_max_bs": max(widths, default=1)}
        off = baseline(model, table_options, [prompt, *others], args.max_new_tokens, widths)
        costs = [verify_cost(model, table_options, k, prompt, args.max_new_tokens,
                             off["decode_ms"], verify_mode=mode)
                 for k in args.ks for mode in args.verify_modes]
        runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
        for _ in range(args.batch_repeats if args.batch else 0):
            for label in runs:
                runs[label].append(batch_throughput(model, options, batch, args.max_new_tokens,
                                                    speculative=label == "on"))
    print(f"batch-1 decode step: {off['decode_ms']:.2f} ms")
    at_batch = off["decode_ms_at_batch"]
    print(format_table(["k", "verify", "graph replays", "verify ms", "verify/decode",
                        "decode ms at batch k+1", "accept len", "x at this acceptance",
                        "x if all accepted"],
                       [[c["k"], c["verify_mode"], f"{c['graph_replays']}/{c['verify_passes']}",
                         c["verify_ms"], c["verify_over_decode"], at_batch[c["k"] + 1],
                         c["accept_length"], c["speedup_at_this_acceptance"],
                         c["speedup_if_all_accepted"]]
                        for c in costs]))
    report: dict[str, Any] = {"benchmark": "speculative_cost",
                              "environment": environment(device), "model": dummy.label,
                              "prompt_len": args.prompt_len,
                              "max_new_tokens": args.max_new_tokens,
                              "decode_ms": off["decode_ms"],
                              "decode_ms_at_batch": off["decode_ms_at_batch"],
                              "verify_costs": costs}
    if args.batch:
        report.update(_batch_report(args, runs))
    path = write_json(args.out, report)
    print(f"wrote {path}")
    return 0


def _batch_report(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]]
                  ) -> dict[str, Any]:
    best = {label: max(results, key=lambda r: r["batch_tok_s"])
            for label, results in runs.items()}
    ratio = best["on"]["batch_tok_s"] / best["off"]["batch_tok_s"]
    for label, results in runs.items():
        print(f"batch {args.batch}, NGRAM {label}: "
              + ", ".join(f"{r['batch_tok_s']:.1f} tok/s ({r['overlapped_passes']} of "
                          f"{r['forward_passes']} passes overlapped)" for r in results))
    print(f"batch {args.batch}: {best['off']['batch_tok_s']:.1f} tok/s off, "
          f"{best['on']['batch_tok_s']:.1f} on (best of {args.batch_repeats}): x{ratio:.3f} "
          f"(speculation: {best['on']['speculative']['state']})")
    return {"batch": args.batch, "batch_tok_s_off": best["off"]["batch_tok_s"],
            "batch_tok_s_on": best["on"]["batch_tok_s"], "batch_ratio": ratio,
            "batch_runs": runs}


if __name__ == "__main__":
    sys.exit(main())
