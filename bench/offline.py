"""nano-vllm's offline throughput workload on lmnb and on HF transformers `generate`.

N sequences of random prompt ids (lengths uniform in [min_input_len, max_input_len]) each with a
fixed output length (uniform in [min_output_len, max_output_len]), drawn exactly as nano-vllm's
bench.py draws them (`random.Random(0)`, ids in [0, 10000]); temperature 0.6 and `ignore_eos`, so
every sequence generates exactly its drawn length.

- lmnb: every prompt in one `Runtime.generate(input_ids=[...], sampling_params=[...])` call.
- HF: `model.generate` on the same weights, `--hf-batch-size` prompts at a time, left-padded,
  `min_new_tokens = max_new_tokens =` the batch's longest output; only each sequence's own
  requested tokens count as output (the rest is the cost of static batching). `--hf-num-seqs`
  / `--hf-max-output-len` give HF a smaller workload (drawn the same way); lmnb then runs that
  one too, in the same runtime, and the ratio compares the two on it.
- The floor of the run's own schedule (CUDA; `bench/floor.py`): every forward pass the scheduler
  ran is logged through `Runtime.set_batch_hook`; per decode pass max(weights + KV bytes / copy
  bandwidth, FLOPs / matmul rate), per prefill pass FLOPs / matmul rate (and the max with its
  bytes, reported apart), both rates measured in this run; lmnb's time over that sum is the
  fraction of the floor it reached.

`--dummy-config llama-2-7b` benchmarks random weights of a real architecture (GPU); the embedded
SmolLM2's tokenizer is used only to detokenize, so the text is meaningless, and ids the
tokenizer does not know are dropped from the text. HF then gets its own random weights of the
same shape (same architecture and cost, not the same values).

    python bench/offline.py                                  # 256 seqs, SmolLM2
    python bench/offline.py --dummy-config llama-2-7b --device cuda
    python bench/offline.py --num-seqs 8 --max-input-len 128 --max-output-len 32 --skip-hf
    python bench/offline.py --dummy-config llama-3-8b --device cuda --tokenizer .gpu/tokenizer \
        --hf-num-seqs 32 --hf-max-output-len 256 --hf-batch-size 32

On a small shared CPU box, `--threads 1` gives steadier ratios (oversubscribed torch threads
slow HF's many small ops far more than lmnb's).
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

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
from bench.dummy_models import DUMMY_CONFIGS  # noqa: E402
from bench.floor import BatchLog, ModelCost, measure_rates, schedule_floor  # noqa: E402
from lmnb.runtime.config import ModelConfig  # noqa: E402
from lmnb.runtime.models import loader  # noqa: E402

SEED = 0
MAX_PROMPT_ID = 10000  # nano-vllm draws prompt ids from randint(0, 10000)
WARMUP_TOKENS = 4

@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    def sampling_params(self, temperature: float) -> list[dict[str, Any]]:
        """Per sequence: exactly its output length (`ignore_eos`) at `temperature`."""
        return [{"max_new_tokens": n, "ignore_eos": True, "temperature": temperature}
                for n in self.output_lens]


@dataclass(frozen=True)
class ModelSpec:
    """What both systems load: a folder (real weights) or a config (random weights)."""

    label: str
    model_dir: Path  # for dummy configs, a temporary folder holding only config.json
    tokenizer_dir: Path | None
    config: Any
    dtype: torch.dtype
    dummy: bool


def make_workload(*, num_seqs: int, min_input_len: int, max_input_len: int,
                  min_output_len: int, max_output_len: int, vocab_size: int) -> Workload:
    """nano-vllm's draw order: every prompt (length, then ids), then every output length."""
    rng = random.Random(SEED)
    top_id = min(MAX_PROMPT_ID, vocab_size - 1)
    prompts = [[rng.randint(0, top_id) for _ in range(rng.randint(min_input_len, max_input_len))]
               for _ in range(num_seqs)]
    output_lens = [rng.randint(min_output_len, max_output_len) for _ in range(num_seqs)]
    return Workload(prompts, output_lens)


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The workload's options (nano-vllm's defaults); `check_workload_args` after parsing."""
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--min-input-len", type=int, default=100)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--min-output-len", type=int, default=100)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--temperature", type=float, default=0.6,
                        help="0 for greedy (default 0.6, as nano-vllm)")


def check_workload_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    # Defaults of the min lengths give way to a smaller max (e.g. --max-output-len 64).
    args.min_input_len = min(args.min_input_len, args.max_input_len)
    args.min_output_len = min(args.min_output_len, args.max_output_len)
    if args.num_seqs < 1 or args.min_input_len < 1 or args.min_output_len < 1:
        parser.error("--num-seqs and the lengths must be >= 1")
    if args.temperature < 0:
        parser.error("--temperature must be >= 0")


def workload_from_args(args: argparse.Namespace, vocab_size: int) -> Workload:
    return make_workload(num_seqs=args.num_seqs, min_input_len=args.min_input_len,
                         max_input_len=args.max_input_len, min_output_len=args.min_output_len,
                         max_output_len=args.max_output_len, vocab_size=vocab_size)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(parser)
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", default=None,
                       help="local HF folder or .gguf (default: the embedded SmolLM2-135M)")
    model.add_argument("--dummy-config", choices=sorted(DUMMY_CONFIGS), default=None,
                       help="random weights of this architecture")
    parser.add_argument("--tokenizer", default=None,
                        help="HF folder whose tokenizer detokenizes --dummy-config outputs "
                             "(default: the embedded SmolLM2's)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-total-tokens", type=int, default=None,
                        help="lmnb KV pool size in tokens (default: sized from free memory)")
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--schedule-policy", default=None,
                        help="lmnb schedule policy (default: the Runtime's)")
    parser.add_argument("--disable-radix-cache", action="store_true")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (CPU; default: torch's choice)")
    parser.add_argument("--skip-hf", action="store_true", help="run lmnb only")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--hf-num-seqs", type=int, default=None,
                        help="HF's (smaller) workload: this many sequences (default: the same "
                             "workload as lmnb); lmnb runs it too for the ratio")
    parser.add_argument("--hf-max-output-len", type=int, default=None,
                        help="HF's workload: output lengths up to this (default --max-output-len)")
    parser.add_argument("--no-floor", action="store_true",
                        help="skip the floor of the schedule (measured on CUDA only)")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "offline.json")
    args = parser.parse_args(argv)
    check_workload_args(parser, args)
    if args.tokenizer is not None and args.dummy_config is None:
        parser.error("--tokenizer goes with --dummy-config (a --model folder has its own)")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be >= 1")
    if args.hf_batch_size < 1:
        parser.error("--hf-batch-size must be >= 1")
    if args.hf_num_seqs is not None and args.hf_num_seqs < 1:
        parser.error("--hf-num-seqs must be >= 1")
    if args.hf_max_output_len is not None and args.hf_max_output_len < 1:
        parser.error("--hf-max-output-len must be >= 1")
    return args


def model_spec(args: argparse.Namespace, scratch: Path, device: torch.device) -> ModelSpec:
    if args.dummy_config is None:
        model_dir = loader.resolve_model_dir(args.model)
        config = loader.load_config(model_dir)
        label = args.model or "embedded SmolLM2-135M-Instruct"
        tokenizer_dir = None
    else:
        from transformers import AutoConfig

        fields = dict(DUMMY_CONFIGS[args.dummy_config])
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        model_dir = scratch / args.dummy_config
        config.save_pretrained(model_dir)
        label = f"dummy {args.dummy_config} (random weights)"
        tokenizer_dir = loader.resolve_model_dir(args.tokenizer)
    dtype = loader.resolve_dtype(args.dtype, ModelConfig.from_hf(config.to_dict()).dtype, device)
    return ModelSpec(label=label, model_dir=model_dir, tokenizer_dir=tokenizer_dir,
                     config=config, dtype=dtype, dummy=args.dummy_config is not None)


def _release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure_workload(rt: Any, workload: Workload, *, temperature: float,
                     rates: dict[str, float] | None, device: torch.device) -> dict[str, Any]:
    """Runs `workload` in one `generate` call on a warm runtime (after a short warm-up request
    and a cache flush); its throughput and, with `rates`, the floor of the passes it ran."""
    longest = max(len(p) + n for p, n in zip(workload.prompts, workload.output_lens, strict=True))
    if longest > rt.context_len:
        raise SystemExit(f"a sequence needs {longest} tokens; lmnb's context length is "
                         f"{rt.context_len} (raise --max-total-tokens or shorten the lengths)")
    params = workload.sampling_params(temperature)
    torch.manual_seed(SEED)
    rt.generate(input_ids=workload.prompts[0][:16],
                sampling_params={**params[0], "max_new_tokens": WARMUP_TOKENS})
    rt.flush_cache()  # the warm-up prompt must not become a cache hit
    before = rt.stats()
    log = BatchLog()
    rt.set_batch_hook(log)
    try:
        with stopwatch(device) as run:
            outputs = rt.generate(input_ids=workload.prompts, sampling_params=params)
    finally:
        rt.set_batch_hook(None)
    after = rt.stats()
    produced = [out["meta_info"]["completion_tokens"] for out in outputs]
    result: dict[str, Any] = {
        "seqs": len(outputs),
        "output_tokens": sum(produced),
        "seconds": run["seconds"],
        "tokens_per_s": sum(produced) / run["seconds"],
        "short_seqs": sum(p < n for p, n in zip(produced, workload.output_lens, strict=True)),
        "forward_passes": after["forward_passes"] - before["forward_passes"],
        "retractions": after["retractions"] - before["retractions"],
        "max_total_tokens": rt.max_total_tokens,
    }
    if rates is not None:
        floor = schedule_floor(log, ModelCost.from_config(rt.model_config, rt.dtype), **rates)
        result["floor"] = floor
        result["floor_tokens_per_s"] = sum(produced) / floor["seconds"]
        result["fraction_of_floor"] = floor["seconds"] / run["seconds"]
        result["fraction_of_floor_issue_definition"] = (
            floor["seconds_issue_definition"] / run["seconds"])
    return result


def run_lmnb(spec: ModelSpec, workloads: dict[str, Workload], args: argparse.Namespace,
             device: torch.device) -> dict[str, dict[str, Any]]:
    """Runs each workload (in order) on one runtime; per workload its throughput and, with
    `args.rates`, the floor of the passes the scheduler ran for it."""
    from lmnb.runtime.engine import Runtime

    with stopwatch(device) as load:
        rt = Runtime(spec.model_dir, dtype=spec.dtype, device=device,
                     tokenizer_path=spec.tokenizer_dir,
                     load_format="dummy" if spec.dummy else "auto",
                     max_total_tokens=args.max_total_tokens,
                     attention_backend=args.attention_backend,
                     disable_radix_cache=args.disable_radix_cache,
                     **({"schedule_policy": args.schedule_policy} if args.schedule_policy else {}))
    results: dict[str, dict[str, Any]] = {}
    try:
        stats = rt.stats()
        engine = {key: stats[key] for key in ("attention_backend", "cuda_graph_batch_sizes",
                                              "cuda_graph_capture_seconds", "fused_kernels")
                  if key in stats}
        for label, workload in workloads.items():
            result = measure_workload(rt, workload, temperature=args.temperature,
                                      rates=args.rates, device=device)
            results[label] = {**result, "load_seconds": load["seconds"], **engine}
    finally:
        rt.close()
        del rt
        _release_memory(device)
    return results


def _load_hf(spec: ModelSpec, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if spec.dummy:
        torch.manual_seed(SEED)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(spec.config, dtype=spec.dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(spec.model_dir, dtype=spec.dtype,
                                                     local_files_only=True).to(device)
    return model.eval()


def _left_padded(prompts: list[list[int]], pad_id: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def _hf_generate(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int,
                 temperature: float, pad_id: int, device: torch.device) -> int:
    """Generates exactly `new_tokens` per prompt; returns how many tokens each row got."""
    ids, mask = _left_padded(prompts, pad_id, device)
    sampling = (dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
                if temperature > 0 else dict(do_sample=False))
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=pad_id, **sampling)
    return out.shape[1] - ids.shape[1]


def run_hf(spec: ModelSpec, workload: Workload, args: argparse.Namespace,
           device: torch.device) -> dict[str, Any]:
    with stopwatch(device) as load:
        model = _load_hf(spec, device)
    config = spec.config
    pad_id = next((t for t in (getattr(config, "pad_token_id", None),
                               getattr(config, "eos_token_id", None)) if isinstance(t, int)), 0)
    size = args.hf_batch_size
    batches = [range(i, min(i + size, len(workload.prompts)))
               for i in range(0, len(workload.prompts), size)]
    try:
        torch.manual_seed(SEED)
        _hf_generate(model, [workload.prompts[0][:16]] * 2, WARMUP_TOKENS, args.temperature,
                     pad_id, device)
        useful = generated = short = 0
        with stopwatch(device) as run:
            for batch in batches:
                wanted = [workload.output_lens[i] for i in batch]
                got = _hf_generate(model, [workload.prompts[i] for i in batch], max(wanted),
                                   args.temperature, pad_id, device)
                useful += sum(min(n, got) for n in wanted)
                generated += got * len(wanted)
                short += sum(got < n for n in wanted)
    finally:
        del model
        _release_memory(device)
    return {
        "seqs": len(workload.prompts),
        "output_tokens": useful,
        "seconds": run["seconds"],
        "tokens_per_s": useful / run["seconds"],
        "load_seconds": load["seconds"],
        "short_seqs": short,
        "batch_size": size,
        "generated_tokens": generated,  # including tokens past a sequence's own length
    }


def _hf_workload(args: argparse.Namespace, main: Workload, vocab_size: int) -> Workload:
    if args.hf_num_seqs is None and args.hf_max_output_len is None:
        return main
    max_output = args.hf_max_output_len or args.max_output_len
    return make_workload(
        num_seqs=args.hf_num_seqs or args.num_seqs, min_input_len=args.min_input_len,
        max_input_len=args.max_input_len, min_output_len=min(args.min_output_len, max_output),
        max_output_len=max_output, vocab_size=vocab_size)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", module="transformers")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    with tempfile.TemporaryDirectory(prefix="lmnb-bench-") as scratch:
        spec = model_spec(args, Path(scratch), device)
        longest = args.max_input_len + args.max_output_len
        if longest > spec.config.max_position_embeddings:
            raise SystemExit(f"max input + output ({longest}) exceeds the model's "
                             f"{spec.config.max_position_embeddings} positions")
        workload = workload_from_args(args, spec.config.vocab_size)
        hf_workload = _hf_workload(args, workload, spec.config.vocab_size)
        separate = hf_workload is not workload and not args.skip_hf
        print(f"offline: {args.num_seqs} seqs, {workload.prompt_tokens:,} prompt tokens, "
              f"{workload.output_tokens:,} output tokens; {spec.label}, {spec.dtype}, {device}")
        if separate:
            print(f"HF comparison workload: {len(hf_workload.prompts)} seqs, "
                  f"{hf_workload.prompt_tokens:,} prompt tokens, "
                  f"{hf_workload.output_tokens:,} output tokens (lmnb runs it too)")
        model_config = ModelConfig.from_hf(spec.config.to_dict())
        args.rates = (measure_rates(device, model_config, spec.dtype)
                      if device.type == "cuda" and not args.no_floor else None)
        if args.rates:
            print(f"measured: copy {args.rates['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
                  f"{spec.dtype} matmul {args.rates['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")
        lmnb_workloads = {"lmnb": workload}
        if separate:
            lmnb_workloads["lmnb_hf_workload"] = hf_workload
        results = run_lmnb(spec, lmnb_workloads, args, device)
        if not args.skip_hf:
            results["hf"] = run_hf(spec, hf_workload, args, device)

    names = {"lmnb": "lmnb", "lmnb_hf_workload": "lmnb (HF's workload)",
             "hf": f"HF generate (batch {args.hf_batch_size})"}
    rows = [(names[k], r["seqs"], r["output_tokens"], r["seconds"], r["tokens_per_s"],
             r.get("floor_tokens_per_s"),
             None if "fraction_of_floor" not in r else f"{100 * r['fraction_of_floor']:.1f}%")
            for k, r in results.items()]
    print(format_table(["system", "seqs", "output tokens", "seconds", "tokens/s",
                        "floor tokens/s", "of floor"], rows))
    for key, result in results.items():
        if result["short_seqs"]:
            print(f"warning: {result['short_seqs']} {names[key]} sequences got fewer tokens "
                  "than requested")
        floor = result.get("floor")
        if floor:
            print(f"{names[key]} schedule: {floor['extend_passes']} prefill passes "
                  f"({floor['extend_tokens']:,} tokens, floor {floor['extend_seconds']:.2f} s), "
                  f"{floor['decode_passes']} decode passes ({floor['decode_tokens']:,} tokens, "
                  f"floor {floor['decode_seconds']:.2f} s, "
                  f"{floor['decode_memory_bound_passes']} memory-bound); "
                  f"{100 * result['fraction_of_floor']:.1f}% of the floor "
                  f"({100 * result['fraction_of_floor_issue_definition']:.1f}% with prefill "
                  "FLOPs only)")
    lmnb_key = "lmnb_hf_workload" if separate else "lmnb"
    ratio = (results[lmnb_key]["tokens_per_s"] / results["hf"]["tokens_per_s"]
             if "hf" in results else None)
    if ratio is not None:
        print(f"lmnb / HF throughput on the same workload: {ratio:.2f}x")

    def workload_info(w: Workload) -> dict[str, int]:
        return {"seqs": len(w.prompts), "prompt_tokens": w.prompt_tokens,
                "output_tokens": w.output_tokens}

    payload = {
        "benchmark": "offline",
        "config": {
            "model": spec.label,
            "dtype": str(spec.dtype).removeprefix("torch."),
            "num_seqs": args.num_seqs,
            "input_len": [args.min_input_len, args.max_input_len],
            "output_len": [args.min_output_len, args.max_output_len],
            "temperature": args.temperature,
            "ignore_eos": True,
            "seed": SEED,
            "hf_batch_size": None if args.skip_hf else args.hf_batch_size,
            "hf_num_seqs": args.hf_num_seqs,
            "hf_max_output_len": args.hf_max_output_len,
            "max_total_tokens": args.max_total_tokens,
            "attention_backend": args.attention_backend,
            "schedule_policy": args.schedule_policy,
            "disable_radix_cache": args.disable_radix_cache,
            "threads": torch.get_num_threads(),
        },
        "workload": workload_info(workload),
        "hf_workload": workload_info(hf_workload) if separate else None,
        "rates": args.rates,
        "results": results,
        "ratio_lmnb_over_hf": ratio,
        "environment": environment(device),
    }
    path = write_json(args.output, payload)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
