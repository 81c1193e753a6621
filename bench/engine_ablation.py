"""The engine switches in one table (GPU): attention backend {FlashInfer, Triton} x CUDA graphs
{on, off} x overlap schedule {on, off}, each row one Runtime on random weights of a real
architecture (default Llama-2-7B fp16), closed before the next.

Columns, all measured in the same process:
- batch-1 decode: one request of a `--prompt-len` prompt; a step is (T(1 + N tokens) - T(1
  token)) / N, the fastest of `--repeats` runs, so that the prefill and the first token drop out;
  its floor is the weight bytes / the device-to-device copy bandwidth (the issue's definition,
  as bench/decode_ablation.py);
- batch-`--batch-size` decode: that many requests of distinct prompts of the same length decoding
  together, timed alike; its floor is floor.py's decode pass (weights + KV read and written at the
  average context length, or the FLOPs when those take longer);
- offline: a reduced nano-vllm workload (`--offline-seqs` sequences, input and output lengths
  uniform in [`--offline-min-len`, `--offline-max-len`], seed 0, temperature 0.6, `ignore_eos`)
  in one `generate` call; output tokens/s and the fraction of the floor of its own schedule
  (bench/floor.py).

FlashInfer rows are skipped when `flashinfer` does not import. A row that fails is reported with
its error and the others go on.

    python bench/engine_ablation.py --tokenizer .gpu/tokenizer
    python bench/engine_ablation.py --tokenizer .gpu/tokenizer --backends triton --graphs on
    python bench/engine_ablation.py --model tiny_model_dir --device cpu --backends torch_native \\
        --graphs off --batch-size 2 --decode-steps 2 --offline-seqs 2 --offline-max-len 8
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    RESULTS_DIR,
    environment,
    format_markdown_table,
    format_table,
    resolve_device,
    stopwatch,
    write_json,
)
from bench.dummy_models import DUMMY_CONFIGS, write_dummy_model  # noqa: E402
from bench.floor import ModelCost, measure_rates  # noqa: E402
from bench.offline import make_workload, measure_workload  # noqa: E402

BACKEND_LABELS = {"flashinfer": "FlashInfer", "triton": "Triton", "torch_native": "torch"}
TEMPERATURE = 0.6  # nano-vllm's


@dataclass(frozen=True)
class AblationRow:
    backend: str
    graphs: bool
    overlap: bool

    @property
    def label(self) -> str:
        return (f"{BACKEND_LABELS.get(self.backend, self.backend)}, "
                f"graphs {'on' if self.graphs else 'off'}, "
                f"overlap {'on' if self.overlap else 'off'}")

    def runtime_options(self) -> dict[str, Any]:
        return {"attention_backend": self.backend, "disable_cuda_graph": not self.graphs,
                "disable_overlap_schedule": not self.overlap}


def ablation_rows(backends: list[str], graphs: list[bool],
                  overlap: list[bool]) -> list[AblationRow]:
    """Every combination, backend-major, the fastest settings (on) first."""
    return [AblationRow(b, g, o) for b in backends for g in graphs for o in overlap]


def flashinfer_imports() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:  # not installed, or its CUDA libraries do not load
        return False
    return True


def _on_off(value: str, flag: str) -> list[bool]:
    values = [v.strip() for v in value.split(",") if v.strip()]
    if not values or set(values) - {"on", "off"}:
        raise argparse.ArgumentTypeError(f"{flag}: on, off or on,off")
    return [v == "on" for v in values]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--dummy-config", default="llama-2-7b", choices=sorted(DUMMY_CONFIGS),
                       help="random weights of this architecture (default llama-2-7b)")
    model.add_argument("--model", default=None,
                       help="a local HF folder instead (e.g. a tiny model for a CPU check)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer folder for --dummy-config (default: the embedded "
                             "SmolLM2's)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default=None,
                        help="default: the architecture's (--dummy-config), else auto")
    parser.add_argument("--backends", default="flashinfer,triton",
                        help="comma list of attention backends (flashinfer, triton, "
                             "torch_native)")
    parser.add_argument("--graphs", default="on,off", help="CUDA graphs: on, off or on,off")
    parser.add_argument("--overlap", default="on,off", help="overlap schedule: on, off or on,off")
    parser.add_argument("--disable-fused-kernels", action="store_true")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=64,
                        help="decode steps timed per run with CUDA graphs on")
    parser.add_argument("--eager-decode-steps", type=int, default=32,
                        help="decode steps timed per run with CUDA graphs off (slower steps)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per decode cell")
    parser.add_argument("--offline-seqs", type=int, default=64)
    parser.add_argument("--offline-min-len", type=int, default=100)
    parser.add_argument("--offline-max-len", type=int, default=512)
    parser.add_argument("--no-offline", action="store_true", help="skip the offline column")
    parser.add_argument("--max-total-tokens", type=int, default=None)
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "engine_ablation.json")
    args = parser.parse_args(argv)
    if args.model is not None:
        args.dummy_config = None
        if args.tokenizer is not None:
            parser.error("--tokenizer goes with --dummy-config (a --model has its own)")
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not args.backends:
        parser.error("--backends: at least one")
    try:
        args.graphs = _on_off(args.graphs, "--graphs")
        args.overlap = _on_off(args.overlap, "--overlap")
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    for name in ("prompt_len", "decode_steps", "eager_decode_steps", "batch_size", "repeats",
                 "offline_seqs", "offline_min_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.offline_max_len < args.offline_min_len:
        parser.error("--offline-max-len must be >= --offline-min-len")
    return args


def _prompts(count: int, length: int, vocab_size: int) -> list[list[int]]:
    """`count` prompts of `length` ids that share no first token (no prefix-cache hits)."""
    top = min(vocab_size, 10000)
    return [[(100 + i + 7 * j) % top for j in range(length)] for i in range(count)]


def decode_step_ms(rt: Any, prompts: list[list[int]], steps: int, repeats: int,
                   device: torch.device) -> dict[str, float]:
    """Milliseconds per decode step of `prompts` decoding together: (T(1 + steps tokens) - T(1
    token)) / steps, fastest runs; the prefix cache is flushed before every run."""

    def timed(new_tokens: int) -> float:
        rt.flush_cache()
        params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": new_tokens}
        with stopwatch(device) as run:
            outs = rt.generate(input_ids=prompts, sampling_params=params)
        assert all(o["meta_info"]["completion_tokens"] == new_tokens for o in outs)
        return run["seconds"]

    timed(4)  # warm-up: this batch size's kernels and allocations
    first = min(timed(1) for _ in range(repeats))
    whole = min(timed(1 + steps) for _ in range(repeats))
    step_ms = 1e3 * max(whole - first, 0.0) / steps
    return {"steps": steps, "first_token_ms": 1e3 * first, "request_seconds": whole,
            "step_ms": step_ms, "tokens_per_s": len(prompts) * 1e3 / step_ms if step_ms else 0.0}


def decode_floor_ms(cost: ModelCost, rates: dict[str, float], batch: int,
                    context: int) -> float:
    """floor.py's decode pass of `batch` requests at `context` tokens each."""
    data_bytes, flops = cost.pass_cost([context] * batch, [1] * batch, batch)
    return 1e3 * max(data_bytes / rates["copy_bytes_per_s"],
                     flops / rates["matmul_flops_per_s"])


def measure_row(row: AblationRow, model_path: str, options: dict[str, Any],
                args: argparse.Namespace, device: torch.device,
                rates: dict[str, float] | None) -> dict[str, Any]:
    from lmnb.runtime.engine import Runtime

    with stopwatch(device) as load:
        rt = Runtime(model_path, device=str(device), max_total_tokens=args.max_total_tokens,
                     disable_fused_kernels=args.disable_fused_kernels,
                     **options, **row.runtime_options())
    try:
        stats = rt.stats()
        result: dict[str, Any] = {
            "label": row.label, "requested": row.runtime_options(),
            "attention_backend": stats["attention_backend"],
            "cuda_graphs": bool(stats["cuda_graph_batch_sizes"]),
            "cuda_graph_capture_seconds": stats["cuda_graph_capture_seconds"],
            "overlap_schedule": stats["overlap_schedule"],
            "fused_kernels": stats["fused_kernels"],
            "load_seconds": load["seconds"], "weight_bytes": rt.weight_bytes,
            "max_total_tokens": rt.max_total_tokens,
        }
        steps = args.decode_steps if result["cuda_graphs"] else args.eager_decode_steps
        vocab = rt.model_config.vocab_size
        cost = ModelCost.from_config(rt.model_config, rt.dtype)
        for key, batch in (("batch_1", 1), ("batch_n", args.batch_size)):
            cell = decode_step_ms(rt, _prompts(batch, args.prompt_len, vocab), steps,
                                  args.repeats, device)
            cell["batch_size"] = batch
            if rates is not None:
                cell["floor_ms"] = (
                    1e3 * rt.weight_bytes / rates["copy_bytes_per_s"] if batch == 1
                    else decode_floor_ms(cost, rates, batch, args.prompt_len + steps // 2))
                cell["fraction_of_floor"] = (cell["floor_ms"] / cell["step_ms"]
                                             if cell["step_ms"] else None)
            result[key] = cell
            print(f"  {row.label}: batch {batch} {cell['step_ms']:.2f} ms/step", flush=True)
        if not args.no_offline:
            workload = make_workload(
                num_seqs=args.offline_seqs, min_input_len=args.offline_min_len,
                max_input_len=args.offline_max_len, min_output_len=args.offline_min_len,
                max_output_len=args.offline_max_len, vocab_size=vocab)
            offline = measure_workload(rt, workload, temperature=TEMPERATURE, rates=rates,
                                       device=device)
            result["offline"] = offline
            print(f"  {row.label}: offline {offline['tokens_per_s']:,.0f} tok/s", flush=True)
    finally:
        rt.close()
        del rt
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def _percent(value: float | None) -> str | None:
    return None if value is None else f"{100 * value:.1f}%"


def _mismatch(run: dict[str, Any]) -> str:
    """' (got ...)' when the runtime ran other switches than the row asked for (e.g. no graphs
    on a CPU, or a backend that cannot be captured)."""
    asked = run["requested"]
    got = []
    if run["attention_backend"] != asked["attention_backend"]:
        got.append(run["attention_backend"])
    if run["cuda_graphs"] == asked["disable_cuda_graph"]:
        got.append(f"graphs {'on' if run['cuda_graphs'] else 'off'}")
    if run["overlap_schedule"] == asked["disable_overlap_schedule"]:
        got.append(f"overlap {'on' if run['overlap_schedule'] else 'off'}")
    return f" (got {', '.join(got)})" if got else ""


TABLE_HEADERS = ["engine", "b1 ms/step", "b1 of floor", "bN ms/step", "bN tok/s", "bN of floor",
                 "offline tok/s", "offline of floor", "graph capture s"]


def table_rows(runs: list[dict[str, Any]]) -> list[list[Any]]:
    """One table row per run; a failed run keeps its label and '-' cells."""
    rows = []
    for run in runs:
        b1, bn, off = run.get("batch_1", {}), run.get("batch_n", {}), run.get("offline", {})
        label = run["label"] + (" (FAILED)" if "error" in run else _mismatch(run))
        rows.append([label, b1.get("step_ms"), _percent(b1.get("fraction_of_floor")),
                     bn.get("step_ms"), bn.get("tokens_per_s"),
                     _percent(bn.get("fraction_of_floor")), off.get("tokens_per_s"),
                     _percent(off.get("fraction_of_floor")),
                     run.get("cuda_graph_capture_seconds") if run.get("cuda_graphs") else None])
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = resolve_device(args.device)
    rows = ablation_rows(args.backends, args.graphs, args.overlap)
    skipped = []
    if "flashinfer" in args.backends and not flashinfer_imports():
        skipped = [r.label for r in rows if r.backend == "flashinfer"]
        rows = [r for r in rows if r.backend != "flashinfer"]
        print("FlashInfer rows skipped: flashinfer does not import", flush=True)
    with tempfile.TemporaryDirectory(prefix="lmnb-ablation-") as scratch:
        if args.dummy_config is not None:
            dummy = write_dummy_model(args.dummy_config, scratch, args.tokenizer,
                                      grow_vocab=False)
            model_path, options, label = str(dummy.path), dummy.runtime_options(), dummy.label
            if args.dtype is not None:
                options["dtype"] = args.dtype
        else:
            model_path, options, label = args.model, {"dtype": args.dtype or "auto"}, args.model
        from lmnb.runtime.models import loader

        model_config = loader.load_model_config(Path(model_path))
        dtype = loader.resolve_dtype(options["dtype"], model_config.dtype, device)
        rates = measure_rates(device, model_config, dtype) if device.type == "cuda" else None
        if rates:
            print(f"measured: copy {rates['copy_bytes_per_s'] / 1e12:.2f} TB/s, {dtype} matmul "
                  f"{rates['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
        runs = []
        for row in rows:
            print(f"{row.label} ...", flush=True)
            start = time.perf_counter()
            try:
                run = measure_row(row, model_path, options, args, device, rates)
            except Exception as error:  # a row that fails must not lose the others
                traceback.print_exc()
                run = {"label": row.label, "requested": row.runtime_options(),
                       "error": repr(error)}
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            run["row_seconds"] = time.perf_counter() - start
            runs.append(run)
    table = table_rows(runs)
    print(f"\nengine ablation: {label}, {dtype}, {device}; batch 1 and batch {args.batch_size} "
          f"decode of {args.prompt_len}-token prompts; offline {args.offline_seqs} seqs, "
          f"lengths {args.offline_min_len}-{args.offline_max_len}, temperature {TEMPERATURE}"
          + ("; fused kernels off" if args.disable_fused_kernels else ""))
    print(format_table(TABLE_HEADERS, table))
    print()
    print(format_markdown_table(TABLE_HEADERS, table))
    if skipped:
        print(f"skipped (flashinfer does not import): {', '.join(skipped)}")
    payload = {
        "benchmark": "engine_ablation", "model": label, "dtype": str(dtype).removeprefix("torch."),
        "config": {"prompt_len": args.prompt_len, "decode_steps": args.decode_steps,
                   "eager_decode_steps": args.eager_decode_steps,
                   "batch_size": args.batch_size, "repeats": args.repeats,
                   "offline": None if args.no_offline else {
                       "seqs": args.offline_seqs,
                       "len": [args.offline_min_len, args.offline_max_len],
                       "temperature": TEMPERATURE, "seed": 0},
                   "fused_kernels": not args.disable_fused_kernels,
                   "max_total_tokens": args.max_total_tokens},
        "rates": rates, "runs": runs, "skipped": skipped,
        "table": {"headers": TABLE_HEADERS, "rows": table},
        "environment": environment(device),
    }
    path = write_json(args.output, payload)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
