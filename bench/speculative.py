"""N-gram speculative decoding (`speculative_algorithm="NGRAM"`) on vs off, batch 1, the embedded
SmolLM2-135M-Instruct (real weights), greedy, three tasks: rewrite a JSON object with one field
changed, answer by quoting a paragraph, free chat.

Two Runtimes on the same weights (one with speculation); for each task each runtime runs the
same request `--repeats` times, alternating, and the fastest run of each counts (the machine is
shared and noisy). The prefix cache and the n-gram corpus of recent requests are flushed before
every run, so drafts come from the request's own prompt and output only. Reported per task:
completion tokens, tok/s off and on, the ratio (and the ratio of this process's CPU time per
token, steadier than wall time on a shared CPU; meaningless on a GPU), verify passes, mean
accepted length (tokens a verify pass yields: accepted drafts + the target's token), acceptance
rate, and whether the greedy texts are identical.

    python bench/speculative.py                    # CPU
    python bench/speculative.py --device cuda --model /tmp/smol/SmolLM2-135M-Instruct
    python bench/speculative.py --device cuda --model <folder> --standalone-self
                                                   # STANDALONE, the draft is the target

On CUDA, verify passes (and STANDALONE's draft catch-up passes) run as decode rows that replay the
decode CUDA graphs (`lmnb/runtime/speculative/rows.py`); the JSON records how many verify passes
replayed a graph (`verify_graph_replays` of the timed verify passes) and `--verify-mode extend` is
the eager ablation.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
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

RECORD = {
    "id": 48213, "name": "Marta Kowalska", "email": "marta.kowalska@example.org",
    "city": "Gdansk", "country": "Poland", "postal_code": "80-001",
    "street": "Dluga 17", "phone": "+48 58 301 22 90", "date_of_birth": "1988-04-12",
    "occupation": "marine biologist", "employer": "Baltic Research Institute",
    "languages": ["Polish", "English", "German"], "newsletter": True,
    "loyalty_points": 1840, "last_login": "2026-11-02T08:15:00Z",
}
PARAGRAPH = (
    "The lighthouse on the northern cape was built in 1874 from granite quarried on the island "
    "itself. Its lamp was first fueled by whale oil, then by kerosene, and finally converted to "
    "electricity in 1931, when a cable was laid across the strait. The keepers lived in a small "
    "stone house at the foot of the tower and recorded the weather every four hours in a "
    "leather-bound logbook. In 1989 the light was automated and the last keeper, Anders Holm, "
    "left the island after thirty-one years of service. Today the tower is a museum, and the "
    "logbooks are kept in the regional archive in Visby."
)
TASKS = {
    "json_rewrite": (
        "Here is a JSON object:\n" + json.dumps(RECORD, indent=2) + "\n\nRewrite this JSON "
        "object with the field \"city\" changed to \"Sopot\". Keep every other field exactly "
        "as it is. Output only the JSON object."),
    "quote_paragraph": (
        "Read this paragraph:\n\n" + PARAGRAPH + "\n\nWhat does the paragraph say about the "
        "lighthouse? Answer by quoting the whole paragraph word for word."),
    "free_chat": "Write a short story about a robot who learns to paint.",
}


def run_once(runtime: Any, prompt: str, max_new_tokens: int
             ) -> tuple[dict[str, Any], float, float]:
    """(output, wall seconds, this process's CPU seconds: steadier on a shared CPU)."""
    runtime.flush_cache()  # no prefix hits, no drafts from earlier runs
    cpu = time.process_time()
    with stopwatch(runtime.device) as timing:
        out = runtime.generate(prompt, {"temperature": 0.0, "max_new_tokens": max_new_tokens})
    return out, timing["seconds"], time.process_time() - cpu


def _verify_replays(before: dict[str, Any], after: dict[str, Any]) -> tuple[int, int]:
    """(verify passes that replayed a decode CUDA graph, verify passes) between two stats()."""
    passes = (after["speculative"]["timed_passes"]["verify"]
              - before["speculative"]["timed_passes"]["verify"])
    return after["verify_graph_replays"] - before["verify_graph_replays"], passes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--model", default=None,
                        help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto",
                        help="auto: float32 on CPU, bfloat16 on GPUs; greedy texts are identical "
                             "token for token in float32 (in bf16 they may part where a verify "
                             "pass's logits differ from a decode's in the last bits)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--num-draft-tokens", type=int, default=None,
                        help="speculative_num_draft_tokens (default: SGLang's 12)")
    parser.add_argument("--verify-mode", default="auto", choices=["auto", "extend", "decode"],
                        help="speculative_verify_mode (auto: decode form under CUDA graphs)")
    parser.add_argument("--standalone-self", action="store_true",
                        help="STANDALONE with the target itself as the draft model (every draft "
                             "accepted): the draft-model pipeline's overhead against its bound")
    parser.add_argument("--num-steps", type=int, default=4,
                        help="speculative_num_steps with --standalone-self")
    parser.add_argument("--tasks", nargs="*", default=list(TASKS))
    parser.add_argument("--out", default=str(RESULTS_DIR / "speculative.json"))
    args = parser.parse_args(argv)

    from lmnb.runtime.engine import Runtime

    device = resolve_device(args.device)
    options: dict[str, Any] = {"device": str(device), "dtype": args.dtype,
                               "max_total_tokens": 8192}
    if args.model is not None:
        options["model_path"] = args.model
    off = Runtime(**options)
    if args.standalone_self:
        from lmnb.runtime.models.loader import resolve_model_dir

        on = Runtime(**options, speculative_algorithm="STANDALONE",
                     speculative_draft_model_path=str(resolve_model_dir(args.model)),
                     speculative_num_steps=args.num_steps, speculative_draft_policy="always",
                     speculative_verify_mode=args.verify_mode)
    else:
        on = Runtime(**options, speculative_algorithm="NGRAM",
                     speculative_num_draft_tokens=args.num_draft_tokens,
                     speculative_verify_mode=args.verify_mode)
    rows, results = [], []
    try:
        for runtime in (off, on):  # warm-up
            runtime.generate("Hello", {"temperature": 0.0, "max_new_tokens": 8})
        for name in args.tasks:
            prompt = on.apply_chat_template([{"role": "user", "content": TASKS[name]}],
                                            add_generation_prompt=True)
            best = {"off": float("inf"), "on": float("inf")}
            best_cpu = dict(best)
            outs: dict[str, dict[str, Any]] = {}
            last_seconds = 0.0
            replayed = (0, 0)  # (verify passes that replayed a decode graph, verify passes)
            for _ in range(args.repeats):
                for label, runtime in (("off", off), ("on", on)):
                    if label == "on":
                        before_stats = on.stats()
                        before = dict(before_stats["speculative"]["seconds"])
                    out, seconds, cpu_seconds = run_once(runtime, prompt, args.max_new_tokens)
                    if label == "on":
                        last_seconds = seconds
                        replayed = _verify_replays(before_stats, on.stats())
                    best[label] = min(best[label], seconds)
                    best_cpu[label] = min(best_cpu[label], cpu_seconds)
                    outs[label] = out
            tokens = outs["off"]["meta_info"]["completion_tokens"]
            meta = outs["on"]["meta_info"]
            verify = meta.get("spec_verify_ct", 0)
            result = {
                "task": name, "completion_tokens": tokens,
                "tok_s_off": tokens / best["off"],
                "tok_s_on": meta["completion_tokens"] / best["on"],
                "cpu_seconds_off": best_cpu["off"], "cpu_seconds_on": best_cpu["on"],
                "verify_passes": verify,
                "forward_passes_on": meta["forward_passes"],
                "forward_passes_off": outs["off"]["meta_info"]["forward_passes"],
                "mean_accept_length": meta.get("spec_accept_length", 0.0),
                "accept_rate": meta.get("spec_accept_rate", 0.0),
                "identical": outs["on"]["output_ids"] == outs["off"]["output_ids"],
                "verify_graph_replays": replayed[0], "timed_verify_passes": replayed[1],
                "text_off": outs["off"]["text"], "text_on": outs["on"]["text"],
            }
            result["speedup"] = result["tok_s_on"] / result["tok_s_off"]
            result["cpu_time_speedup"] = (best_cpu["off"] / tokens) / (
                best_cpu["on"] / meta["completion_tokens"])
            if args.standalone_self and verify:
                # Per step: k draft passes (the draft is the target: each at least a decode)
                # and one verify pass. The bound is the accepted length over that cost in
                # decode passes (decode time: the off run's per token); the efficiency is the
                # share of the on run spent in those passes (the rest: the pipeline's own work).
                spent = on.stats()["speculative"]["seconds"]
                spent = {key: spent[key] - before[key] for key in spent}
                decode = best["off"] / tokens
                steps = verify
                result["bound_speedup"] = result["mean_accept_length"] / (
                    args.num_steps + spent["verify"] / steps / decode)
                result["step_cost_in_decodes"] = (spent["draft"] + spent["verify"]) / steps / decode
                result["share_in_passes"] = (spent["draft"] + spent["verify"]
                                                 + spent["decode"]) / last_seconds
            results.append(result)
            rows.append([name, tokens, result["tok_s_off"], result["tok_s_on"],
                         result["speedup"], result["cpu_time_speedup"], verify,
                         result["mean_accept_length"], result["accept_rate"],
                         result["identical"]])
        stats = on.stats()["speculative"]
    finally:
        off.close()
        on.close()
    print(format_table(["task", "tokens", "tok/s off", "tok/s on", "ratio", "cpu-time ratio",
                        "verifies", "accept len", "accept rate", "identical"], rows))
    for result in results:
        print(f"{result['task']}: x{result['speedup']:.2f} wall, "
              f"x{result['cpu_time_speedup']:.2f} process CPU time; "
              f"{result['verify_graph_replays']} of {result['timed_verify_passes']} verify passes "
              f"replayed a CUDA graph (last run)")
        if "bound_speedup" in result:
            print(f"  STANDALONE (draft = target): bound x{result['bound_speedup']:.2f} "
                  f"(accepted length over k draft passes + the measured verify pass), "
                  f"share of the run in model passes {result['share_in_passes']:.2f}")
    path = write_json(args.out, {
        "benchmark": "speculative", "environment": environment(device),
        "model": args.model or "SmolLM2-135M-Instruct (embedded)", "batch_size": 1,
        "algorithm": "STANDALONE (draft = target)" if args.standalone_self else "NGRAM",
        "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
        "dtype": str(off.dtype),
        "num_draft_tokens": stats["num_draft_tokens"], "verify_mode": args.verify_mode,
        "results": results,
        "speculative_stats": stats})
    print(f"wrote {path}")
    exact = str(off.dtype) == "torch.float32"
    return 0 if all(r["identical"] for r in results) or not exact else 1


if __name__ == "__main__":
    sys.exit(main())
