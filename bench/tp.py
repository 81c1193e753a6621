"""Tensor parallelism: TP=N against TP=1 in one run, on random weights of a real architecture
(`load_format="dummy"`: every tensor-parallel size draws the same model): batch-1 decode step
time, and greedy agreement (bf16: share of equal tokens; fp32: equal sequences and the largest
logprob difference of the chosen tokens).

    python bench/tp.py --tokenizer <SmolLM2 tokenizer folder>        # 2 GPUs, Llama-2-7B
    python bench/tp.py --model-config smollm2-135m --device cpu --dtype float32 --steps 8 \\
        --agreement-tokens 8 --skip-fp32                               # a CPU smoke run (gloo)

A decode step's time is (t(n2) - t(n1)) / (n2 - n1) of two batch-1 generations of the same
prompt (n1 and n2 new tokens), so prefill and per-request costs cancel; the median of
`--repeats`. `tp_send_ms` is rank 0's host time per step handing each batch to the workers.
Each Runtime runs in a child process with a deadline (`--run-timeout`): a hang is reported
(e.g. try `--disable-cuda-graph`) and the other runs still happen.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS_DIR, environment, format_table, write_json  # noqa: E402
from bench.dummy_models import DUMMY_CONFIGS  # noqa: E402

GREEDY = {"temperature": 0, "ignore_eos": True}
SEED = 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-config", default="llama-2-7b", choices=sorted(DUMMY_CONFIGS))
    parser.add_argument("--tokenizer", default=os.environ.get("LMNB_TOKENIZER_DIR"),
                        help="HF folder with a tokenizer (default: $LMNB_TOKENIZER_DIR, else the "
                             "embedded SmolLM2's)")
    parser.add_argument("--tp-size", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", help="dtype of the timed runs")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed (n2 - n1)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--agreement-prompts", type=int, default=4)
    parser.add_argument("--agreement-tokens", type=int, default=32)
    parser.add_argument("--skip-fp32", action="store_true",
                        help="skip the fp32 agreement runs (they hold fp32 weights)")
    parser.add_argument("--max-total-tokens", type=int, default=8192)
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--disable-cuda-graph", action="store_true")
    parser.add_argument("--run-timeout", type=float, default=480.0,
                        help="seconds one Runtime (load, capture, runs) may take")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "tp.json")
    parser.add_argument("--child-run", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-model-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tp_size < 2:
        parser.error("--tp-size must be >= 2 (it is compared with TP=1)")
    return args


def _prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(SEED)
    return [[rng.randrange(3, min(vocab, 32000)) for _ in range(length)] for _ in range(count)]


def _timed(rt: Any, prompt: list[int], new_tokens: int, device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    rt.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": new_tokens})
    return time.perf_counter() - start


def run_one(model_dir: Path, args: argparse.Namespace, *, tp_size: int, dtype: str,
            timed: bool) -> dict[str, Any]:
    """One Runtime: its decode step time (when `timed`) and its greedy outputs."""
    from lmnb.runtime.engine import Runtime

    fields = DUMMY_CONFIGS[args.model_config]
    start = time.perf_counter()
    rt = Runtime(model_dir, tokenizer_path=args.tokenizer, load_format="dummy",
                 device=args.device, dtype=dtype, tp_size=tp_size,
                 max_total_tokens=args.max_total_tokens, max_running_requests=8,
                 attention_backend=args.attention_backend,
                 disable_cuda_graph=args.disable_cuda_graph, cuda_graph_max_bs=4)
    result: dict[str, Any] = {"tp_size": tp_size, "dtype": dtype,
                              "load_seconds": time.perf_counter() - start,
                              "weight_gb_per_rank": rt.weight_bytes / 1e9}
    try:
        stats = rt.stats()
        result["attention_backend"] = stats["attention_backend"]
        result["cuda_graph_batch_sizes"] = stats["cuda_graph_batch_sizes"]
        vocab = fields["vocab_size"]
        if timed:
            prompt = _prompts(1, args.prompt_len, vocab)[0]
            rt.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 8})
            n1, n2 = 8, 8 + args.steps
            steps = []
            before = rt.stats()
            for _ in range(args.repeats):
                rt.flush_cache()
                t1 = _timed(rt, prompt, n1, args.device)
                rt.flush_cache()
                t2 = _timed(rt, prompt, n2, args.device)
                steps.append((t2 - t1) / (n2 - n1))
            after = rt.stats()
            result["step_ms"] = statistics.median(steps) * 1e3
            result["step_ms_all"] = [s * 1e3 for s in steps]
            sent = after["tp_steps_sent"] - before["tp_steps_sent"]
            result["tp_send_ms"] = ((after["tp_step_send_seconds"]
                                     - before["tp_step_send_seconds"]) / sent * 1e3
                                    if sent else 0.0)
        prompts = _prompts(args.agreement_prompts, args.prompt_len, vocab)
        outs = rt.generate(input_ids=prompts,
                           sampling_params={**GREEDY, "max_new_tokens": args.agreement_tokens},
                           return_logprob=True)
        result["output_ids"] = [o["output_ids"] for o in outs]
        result["output_logprobs"] = [[lp for lp, _, *_ in o["meta_info"]["output_token_logprobs"]]
                                     for o in outs]
    finally:
        rt.close()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return result


def agreement(base: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Equal tokens position by position, equal sequences, common-prefix share, and the largest
    chosen-token logprob difference before the first disagreement."""
    equal = total = same_sequences = prefix = 0
    max_diff = 0.0
    for ids_a, ids_b, lp_a, lp_b in zip(base["output_ids"], other["output_ids"],
                                        base["output_logprobs"], other["output_logprobs"],
                                        strict=True):
        equal += sum(a == b for a, b in zip(ids_a, ids_b, strict=True))
        total += len(ids_a)
        same_sequences += ids_a == ids_b
        common = next((i for i, (a, b) in enumerate(zip(ids_a, ids_b, strict=True)) if a != b),
                      len(ids_a))
        prefix += common
        diffs = [abs(a - b) for a, b in zip(lp_a[:common], lp_b[:common], strict=True)]
        max_diff = max([max_diff, *diffs])
    return {"token_agreement": equal / total, "common_prefix_share": prefix / total,
            "equal_sequences": same_sequences, "sequences": len(base["output_ids"]),
            "max_logprob_diff": max_diff}


def run_child(argv: list[str], model_dir: str, *, tp_size: int, dtype: str, timed: bool,
              timeout: float) -> dict[str, Any]:
    """`run_one` in a child process (this script with --child-run), within `timeout` seconds."""
    command = [sys.executable, str(Path(__file__).resolve()), *argv, "--child-run",
               f"{tp_size}:{dtype}:{int(timed)}", "--child-model-dir", model_dir]
    try:
        done = subprocess.run(command, stdout=subprocess.PIPE, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"tp_size": tp_size, "dtype": dtype,
                "error": f"did not finish in {timeout:.0f} s (a hang? try --disable-cuda-graph)"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        return {"tp_size": tp_size, "dtype": dtype,
                "error": f"exited with code {done.returncode} (its stderr is above)"}
    return json.loads(lines[-1].removeprefix("RESULT "))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 agreement: no TF32 on rank 0
    if args.child_run is not None:
        tp_size, dtype, timed = args.child_run.split(":")
        result = run_one(Path(args.child_model_dir), args, tp_size=int(tp_size), dtype=dtype,
                         timed=timed == "1")
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    from transformers import AutoConfig

    from lmnb.runtime.models import loader

    argv += ["--tokenizer", str(loader.resolve_model_dir(args.tokenizer))]
    runs: dict[str, dict[str, Any]] = {}
    plan = [(f"tp{n}", n, args.dtype, True) for n in (1, args.tp_size)]
    if not args.skip_fp32:
        plan += [(f"tp{n}_fp32", n, "float32", False) for n in (1, args.tp_size)]
    with tempfile.TemporaryDirectory() as scratch:
        fields = dict(DUMMY_CONFIGS[args.model_config])
        AutoConfig.for_model(fields.pop("model_type"), **fields).save_pretrained(scratch)
        for name, tp_size, dtype, timed in plan:
            runs[name] = run_child(argv, scratch, tp_size=tp_size, dtype=dtype, timed=timed,
                                   timeout=args.run_timeout)
            if "error" in runs[name]:
                print(f"{name}: {runs[name]['error']}", flush=True)
    ratios: dict[str, Any] = {}
    tp1, tpn = runs["tp1"], runs[f"tp{args.tp_size}"]
    if "step_ms" in tp1 and "step_ms" in tpn:
        ratios["decode_step_speedup"] = tp1["step_ms"] / tpn["step_ms"]
        ratios["agreement"] = agreement(tp1, tpn)
    fp32 = runs.get("tp1_fp32", {}), runs.get(f"tp{args.tp_size}_fp32", {})
    if all("output_ids" in run for run in fp32):
        ratios["agreement_fp32"] = agreement(*fp32)
    rows = [[name, run["dtype"], run.get("step_ms"), run.get("tp_send_ms"),
             run.get("weight_gb_per_rank"), run.get("load_seconds"),
             run.get("attention_backend", run.get("error"))]
            for name, run in runs.items()]
    print(f"{args.model_config}, random weights, batch-1 decode, prompt {args.prompt_len} "
          f"tokens, {args.steps} steps timed")
    print(format_table(["run", "dtype", "step ms", "send ms", "GB/rank", "load s", "backend"],
                       rows))
    if "decode_step_speedup" in ratios:
        print(f"TP={args.tp_size} decode step speedup over TP=1: "
              f"{ratios['decode_step_speedup']:.2f}x")
    for key in ("agreement", "agreement_fp32"):
        if key in ratios:
            a = ratios[key]
            print(f"{key}: {a['token_agreement']:.1%} equal tokens, {a['equal_sequences']}/"
                  f"{a['sequences']} equal sequences, max logprob diff "
                  f"{a['max_logprob_diff']:.2e} (before the first disagreement)")
    payload = {"benchmark": "tp",
               "args": {k: str(v) for k, v in vars(args).items() if not k.startswith("child")},
               "environment": environment(args.device), "runs": runs, "ratios": ratios}
    path = write_json(args.output, payload)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
