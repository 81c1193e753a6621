"""FP8 weights and FP8 KV cache against bf16, in one run (issue 23's table).

Variants (one `Runtime` each, built one after the other and closed between):
  bf16          the model as it ships (bf16)
  fp8           quantization="fp8": linears quantized at load (per-channel scales)
  fp8-kv        kv_cache_dtype="fp8_e4m3" on bf16 weights
  fp8+fp8-kv    both
  fp8-unfused   fp8 with decode's RMSNorms and SiLU-and-mul as their own kernels, not inside
                the skinny GEMMs (`layers.linear.FP8_DECODE_FUSIONS`; not run by default)
  fp8-quant-apart  fp8 with the W8A8 GEMMs' inputs quantized by their own kernel, not inside the
                RMSNorm / SiLU-and-mul kernels (`layers.linear.FP8_QUANT_FUSIONS`; not by default)
  fp8-unswapped-rows  fp8 with 2-16 rows through the W8A8 GEMM without swapped operands (mma.sync
                over f16 conversions, not FP8 wgmma; `kernels.fused.mm_fp8.W8A8_DECODE_SWAP_AB`;
                before session 32; not by default)
  fp8-skinny-rows  fp8 with 2-16 rows (decode at batch 2-16) through the skinny W8A16 kernel
                (16-bit activations, its dot path) instead of per-token FP8 rows through the
                split-K W8A8 GEMM (`layers.fp8.W8A16_MAX_ROWS`; before session 31; not by
                default)

Parts (`--parts`, default all):
  decode    random Llama-3-8B (`--model`), one 128-id prompt, ms per decode step as
            (T(16 + 256 new tokens) - T(16)) / 256 (medians of `--repeats` runs), tok/s, and the
            floor: the runtime's weight bytes (`Runtime.weight_bytes`) / copy bandwidth measured
            in this run; FP8's speed-up over bf16 and its fraction of its own floor.
            `--decode-batch 1,8,32` times each batch size (that many prompts) in turn on the
            same runtime: one model build per variant
  offline   nano-vllm's offline workload (bench/offline.py: 256 seqs, in/out lengths 100-1024,
            seed 0, temperature 0.6), one generate call: output tok/s and the KV pool's tokens
  w8a16     (not by default) weight-only FP8 GEMMs of more than 16 rows at Llama-3-8B's linears:
            `mm_fp8.w8a16_mm` against dequantize + F.linear, bf16 and W8A8 beside them
  quality   real weights (the embedded SmolLM2-135M-Instruct, or `--quality-model`), real text
            (bench/data/opticks.txt, Newton's Opticks, public domain): the first
            `--quality-tokens` tokens as one prompt, prompt logprobs of every position: each
            variant's next-token top-1 agreement with bf16 and its perplexity against bf16's;
            first the noise floor (`--floor`: fp32 and fp16 against bf16), and agreement on the
            positions where bf16's top-1 beats its top-2 by > 0.1 / 0.5 (logprob); then the
            FP8 checkpoints of `--quality-checkpoints` (bench/fp8_gptq.py, written from the
            quality model into a temporary folder, calibrated on the text past the measured
            tokens): fp8-w8a16 (weight-only FP8, round to nearest), fp8-gptq (weight-only,
            GPTQ), fp8-gptq-ends (that with the first and last decoder layers 16-bit),
            fp8-gptq-w8a8 (GPTQ weights, per-token FP8 activations)

JSON to bench/results/fp8.json (and $OUT/fp8.json when $OUT is set). On the GPU machine:
    python bench/fp8.py                                  # all parts, about 6 minutes on an H100
    python bench/fp8.py --parts quality --quality-model /tmp/smollm2
    python bench/fp8.py --parts quality --quality-model /tmp/smollm2 --variants bf16,fp8,fp8-kv \
        --quality-checkpoints fp8-w8a16,fp8-gptq,fp8-gptq-ends,fp8-gptq-w8a8
    python bench/fp8.py --parts decode --variants bf16,fp8   # batch-1 decode only (~2 minutes)
    python bench/fp8.py --parts decode --variants bf16,fp8 \
        --fp8-gemv-table bench/results/gemv_fp8_sweep.json    # with a sweep's best FP8 configs
CPU check (tiny sizes and a tiny random Llama-3 shape; the reference FP8 path):
    python bench/fp8.py --tiny
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    REPO_ROOT,
    RESULTS_DIR,
    environment,
    format_table,
    stopwatch,
    write_results,
)
from bench.dummy_models import write_dummy_model  # noqa: E402
from bench.floor import copy_bandwidth  # noqa: E402
from bench.offline import make_workload, measure_workload  # noqa: E402
from lmnb.runtime.engine import Runtime  # noqa: E402
from lmnb.runtime.models.layers import fp8, linear  # noqa: E402

VARIANTS: dict[str, dict[str, Any]] = {
    "bf16": {},
    "fp8": {"quantization": "fp8"},
    "fp8-kv": {"kv_cache_dtype": "fp8_e4m3"},
    "fp8+fp8-kv": {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"},
    "fp8-unfused": {"quantization": "fp8"},  # decode's norms and SiLU apart (ablation)
    "fp8-quant-apart": {"quantization": "fp8"},  # per_token_quant apart (ablation)
    "fp8-skinny-rows": {"quantization": "fp8"},  # 2-16 rows skinny W8A16, not W8A8
    "fp8-unswapped-rows": {"quantization": "fp8"},  # 2-16 rows W8A8, operands unswapped
}
DEFAULT_VARIANTS = ("bf16", "fp8", "fp8-kv", "fp8+fp8-kv")
W8A16_MAX_ROWS = fp8.W8A16_MAX_ROWS  # the runtime's, restored after each variant
# The noise floor of the quality part: the model in other 16/32-bit dtypes against bf16.
FLOOR_VARIANTS: dict[str, dict[str, Any]] = {
    "fp32": {"dtype": "float32"},
    "fp16": {"dtype": "float16"},
}
# bench/fp8_gptq.py checkpoints of the quality model: (weight_only, gptq, first and last
# decoder layers 16-bit)
QUALITY_CHECKPOINTS = {"fp8-w8a16": (True, False, False), "fp8-gptq": (True, True, False),
                       "fp8-gptq-ends": (True, True, True), "fp8-gptq-w8a8": (False, True, False)}
MARGINS = (0.1, 0.5)  # top-1 - top-2 logprob margins of the margin-aware agreement
TEXT = REPO_ROOT / "bench" / "data" / "opticks.txt"
PARTS = ("decode", "offline", "quality", "w8a16")
DEFAULT_PARTS = ("decode", "offline", "quality")
# Llama-3-8B's linears (N, K): qkv, o, gate_up, down
W8A16_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                "down": (4096, 14336)}
W8A16_ROWS = (17, 64, 256, 1024, 4096)


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def decode_step_ms(rt: Runtime, *, steps: int, repeats: int, device: torch.device,
                   batch: int = 1) -> float:
    """ms per decode step of `batch` 128-id prompts: (T(16 + steps) - T(16)) / steps, medians of
    `repeats`."""
    prompts = [list(range(1000 + 200 * i, 1128 + 200 * i)) for i in range(batch)]

    def timed(new_tokens: int) -> float:
        times = []
        for _ in range(repeats):
            rt.flush_cache()
            with stopwatch(device) as t:
                rt.generate(input_ids=prompts if batch > 1 else prompts[0], sampling_params={
                    "max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True})
            times.append(t["seconds"])
        return statistics.median(times)

    timed(16)  # warm-up
    return (timed(16 + steps) - timed(16)) / steps * 1e3


class PromptScores(NamedTuple):
    """Per position t >= 1 of a prompt: the top-1 and top-2 next-token ids predicted for it, the
    logprob of the text's token there, and the top-1 - top-2 logprob margin."""

    top1: list[int]
    top2: list[int]
    logprobs: list[float]
    margins: list[float]


def quality_logprobs(rt: Runtime, ids: list[int]) -> PromptScores:
    out = rt.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0},
                      return_logprob=True, top_logprobs_num=2, logprob_start_len=0)
    meta = out["meta_info"]
    tops = [meta["input_top_logprobs"][t] for t in range(1, len(ids))]
    logprobs = [meta["input_token_logprobs"][t][0] for t in range(1, len(ids))]
    return PromptScores([top[0][1] for top in tops], [top[1][1] for top in tops], logprobs,
                        [top[0][0] - top[1][0] for top in tops])


def agreement_rows(top1: list[int], reference: PromptScores) -> dict[str, float]:
    """Top-1 agreement with the reference, overall and on the positions where the reference's
    top-1 beats its top-2 by more than each of MARGINS (near-ties flip under any noise). Where
    the reference's top two tie exactly (16-bit logits do at a few % of positions), either one
    is its top-1."""
    same = [a == r1 or (gap == 0 and a == r2) for a, r1, r2, gap in
            zip(top1, reference.top1, reference.top2, reference.margins, strict=True)]
    row = {"top1_agreement": sum(same) / len(same)}
    for m in MARGINS:
        kept = [s for s, gap in zip(same, reference.margins, strict=True) if gap > m]
        row[f"top1_agreement_margin_{m}"] = sum(kept) / max(len(kept), 1)
    return row


def run_quality(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """bf16 first (the reference), then the noise floor (the same model at other 16/32-bit
    dtypes: no FP8 scheme can agree with bf16 better than fp32 does), then the FP8 variants."""
    model = None if args.quality_model is None else str(args.quality_model)
    text = TEXT.read_text().split("\n", 2)[2]  # without the provenance line
    results: dict[str, Any] = {"text": f"{TEXT.name}: Newton, Opticks (public domain)"}
    reference: PromptScores | None = None
    names = [args.variants[0], *args.floor, *args.variants[1:], *args.quality_checkpoints]
    scratch = tempfile.TemporaryDirectory(prefix="fp8-quality-")
    for name in names:
        options = {"dtype": args.dtype, **FLOOR_VARIANTS.get(name, VARIANTS.get(name, {}))}
        folder = (str(_quality_checkpoint(args, name, Path(scratch.name)))
                  if name in QUALITY_CHECKPOINTS else model)
        with Runtime(folder, device=str(device), **options,
                     context_length=args.quality_tokens + 8,
                     chunked_prefill_size=args.quality_tokens + 8) as rt:
            ids = rt.tokenizer.encode(text)[:args.quality_tokens]
            scores = quality_logprobs(rt, ids)
        top1, logprobs, margins = scores.top1, scores.logprobs, scores.margins
        ppl = math.exp(-sum(logprobs) / len(logprobs))
        row: dict[str, Any] = {"positions": len(top1), "perplexity": ppl}
        if reference is None:
            reference = scores
            row |= {f"positions_margin_below_{m}": sum(g <= m for g in margins) / len(margins)
                    for m in MARGINS}
        else:
            ref_ppl = math.exp(-sum(reference.logprobs) / len(reference.logprobs))
            row |= agreement_rows(top1, reference) | {"perplexity_vs_bf16": ppl / ref_ppl - 1}
        results[name] = row
        _free()
    results["rows"] = names
    scratch.cleanup()
    return results


def run_w8a16(device: torch.device, rows: tuple[int, ...] = W8A16_ROWS) -> dict[str, Any]:
    """Weight-only FP8 GEMMs (more than 16 rows) at Llama-3-8B's four linears: ms for the sum of
    the four, per row count: bf16 F.linear, W8A8 (`_scaled_mm` + per-token quantization, what
    quantization='fp8' runs), W8A16 through `mm_fp8.w8a16_mm`, W8A16 as dequantize + F.linear."""
    from lmnb.runtime.models.layers import fp8

    def ms(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> float:
        for _ in range(3):
            fn(*args, **kwargs)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(10):
            start.record()
            fn(*args, **kwargs)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    gen = torch.Generator(device=device).manual_seed(0)
    weights = []
    for n, k in W8A16_SHAPES.values():
        w16 = (torch.randn(n, k, device=device, generator=gen) / k ** 0.5).bfloat16()
        weights.append((w16, *fp8.quantize_rows(w16)))
    out: dict[str, Any] = {}
    for m in rows:
        row = dict.fromkeys(("bf16", "w8a8", "w8a16_kernel", "w8a16_dequant"), 0.0)
        for w16, w8, scale in weights:
            x = torch.randn(m, w16.shape[1], device=device, generator=gen).bfloat16()
            row["bf16"] += ms(torch.nn.functional.linear, x, w16)
            row["w8a8"] += ms(fp8.fp8_linear, x, w8, scale, None, fused=True)
            row["w8a16_kernel"] += ms(fp8.fp8_linear, x, w8, scale, None, fused=True,
                                      weight_only=True)
            row["w8a16_dequant"] += ms(fp8.fp8_linear, x, w8, scale, None, fused=False,
                                       weight_only=True)
        out[str(m)] = row
        _free()
    return out


def _quality_checkpoint(args: argparse.Namespace, name: str, root: Path) -> Path:
    """bench/fp8_gptq.py's checkpoint `name` of the quality model, calibrated on the text's
    tokens past the measured ones."""
    from bench.fp8_gptq import calibration_ids, write_fp8_checkpoint
    from lmnb.runtime.models.loader import resolve_model_dir

    source = args.quality_model or resolve_model_dir(None)
    weight_only, gptq, ends = QUALITY_CHECKPOINTS[name]
    calib = None
    if gptq:
        calib = (calibration_ids(source, args.quality_tokens, 1024) if args.calib_text is None
                 else calibration_ids(source, 0, args.calib_tokens, args.calib_text))
    layers = json.loads((Path(source) / "config.json").read_text())["num_hidden_layers"]
    return write_fp8_checkpoint(source, root / name, weight_only=weight_only, gptq=gptq,
                                calib=calib, skip_layers=(0, layers - 1) if ends else ())


def run_speed(args: argparse.Namespace, device: torch.device,
              parts: set[str]) -> dict[str, Any]:
    from lmnb.runtime.kernels.fused import mm_fp8  # triton: imported where the speed runs

    swap_ab = mm_fp8.W8A8_DECODE_SWAP_AB  # the runtime's, restored after each variant

    with tempfile.TemporaryDirectory() as root:
        spec = write_dummy_model(args.model, root, args.tokenizer, grow_vocab=False)
        bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
        workload = make_workload(num_seqs=args.num_seqs, min_input_len=100,
                                 max_input_len=args.max_len, min_output_len=100,
                                 max_output_len=args.max_len,
                                 vocab_size=spec.fields["vocab_size"])
        results: dict[str, Any] = {"model": spec.label, "copy_bandwidth_gbs":
                                   bandwidth and bandwidth / 1e9}
        for name in args.variants:
            options = VARIANTS[name]
            row: dict[str, Any] = {}
            linear.FP8_DECODE_FUSIONS = name != "fp8-unfused"
            linear.FP8_QUANT_FUSIONS = name != "fp8-quant-apart"
            fp8.W8A16_MAX_ROWS = (fp8.SKINNY_MAX_ROWS if name == "fp8-skinny-rows" else
                                  W8A16_MAX_ROWS)
            mm_fp8.W8A8_DECODE_SWAP_AB = swap_ab and name != "fp8-unswapped-rows"
            with Runtime(str(spec.path), device=str(device),
                         **{**spec.runtime_options(), **options, **args.runtime_options}) as rt:
                row["weight_gb"] = rt.weight_bytes / 1e9
                row["kv_tokens"] = rt.max_total_tokens
                if "decode" in parts:
                    by_batch = {}
                    for batch in args.decode_batch:
                        ms = decode_step_ms(rt, steps=args.steps, repeats=args.repeats,
                                            device=device, batch=batch)
                        by_batch[batch] = {"decode_ms_per_step": ms, "decode_tok_s": 1e3 / ms}
                        if bandwidth:
                            floor_ms = rt.weight_bytes / bandwidth * 1e3
                            by_batch[batch] |= {"floor_ms": floor_ms,
                                                "fraction_of_floor": floor_ms / ms}
                    row |= by_batch[args.decode_batch[0]]  # the first size, as one size reads
                    if len(by_batch) > 1:
                        row["decode_by_batch"] = by_batch
                if "offline" in parts:
                    measured = measure_workload(rt, workload, temperature=0.6, rates=None,
                                                device=device)
                    row |= {"offline_tok_s": measured["tokens_per_s"],
                            "offline_seconds": measured["seconds"],
                            "offline_retractions": measured["retractions"]}
            results[name] = row
            linear.FP8_DECODE_FUSIONS = linear.FP8_QUANT_FUSIONS = True
            fp8.W8A16_MAX_ROWS = W8A16_MAX_ROWS
            mm_fp8.W8A8_DECODE_SWAP_AB = swap_ab
            _free()
        return results


def _ratios(speed: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    base = speed.get("bf16", {})
    for name in VARIANTS:
        row = speed.get(name, {})
        if "decode_tok_s" in row and "decode_tok_s" in base:
            out[f"decode {name}/bf16"] = row["decode_tok_s"] / base["decode_tok_s"]
        for batch, timed in row.get("decode_by_batch", {}).items():
            out[f"decode b{batch} {name}/bf16"] = (
                timed["decode_tok_s"] / base["decode_by_batch"][batch]["decode_tok_s"])
        if "offline_tok_s" in row and "offline_tok_s" in base:
            out[f"offline {name}/bf16"] = row["offline_tok_s"] / base["offline_tok_s"]
        if "kv_tokens" in row and "kv_tokens" in base:
            out[f"kv tokens {name}/bf16"] = row["kv_tokens"] / base["kv_tokens"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default=",".join(DEFAULT_PARTS))
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help="comma-separated, bf16 first (the ratios' base)")
    parser.add_argument("--model", default="llama-3-8b", help="bench/dummy_models.py name")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="tokenizer folder for the random model (default: SmolLM2's)")
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--decode-batch", default="1",
                        help="requests decoded together in the decode part; comma-separated "
                             "sizes are timed in turn")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--quality-model", type=Path, default=None,
                        help="HF folder of SmolLM2-135M-Instruct (default: the embedded one)")
    parser.add_argument("--quality-tokens", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--floor", default=",".join(FLOOR_VARIANTS),
                        help="quality part: the 16/32-bit rows compared with bf16 ('' for none)")
    parser.add_argument("--quality-checkpoints", default="",
                        help=f"quality part: some of {list(QUALITY_CHECKPOINTS)} (comma-separated)")
    parser.add_argument("--calib-text", type=Path, default=None,
                        help="GPTQ checkpoints: calibrate on this file (default: opticks.txt "
                             "past the measured tokens)")
    parser.add_argument("--calib-tokens", type=int, default=4096,
                        help="with --calib-text: how many of its tokens")
    parser.add_argument("--tiny", action="store_true", help="CPU-sized check of the script")
    parser.add_argument("--fp8-gemv-table", type=Path, default=None,
                        help="a `bench/gemv.py --fp8 --sweep` JSON: its best configs replace "
                             "gemv_fp8's table for this run")
    parser.add_argument("--attention-backend", default=None,
                        help="every variant's attention backend (Runtime's option; default: "
                             "the device's)")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if parts - set(PARTS):
        parser.error(f"--parts: unknown {sorted(parts - set(PARTS))}; known: {PARTS}")
    args.variants = args.variants.split(",")
    args.decode_batch = [int(size) for size in args.decode_batch.split(",")]
    if min(args.decode_batch) < 1 or len(set(args.decode_batch)) < len(args.decode_batch):
        parser.error("--decode-batch: distinct sizes of at least 1")
    args.floor = [name for name in args.floor.split(",") if name]
    args.quality_checkpoints = [n for n in args.quality_checkpoints.split(",") if n]
    if set(args.quality_checkpoints) - set(QUALITY_CHECKPOINTS):
        parser.error(f"--quality-checkpoints: some of {list(QUALITY_CHECKPOINTS)}")
    if set(args.floor) - set(FLOOR_VARIANTS):
        parser.error(f"--floor: some of {list(FLOOR_VARIANTS)}")
    if set(args.variants) - set(VARIANTS) or args.variants[0] != "bf16":
        parser.error(f"--variants: bf16 first, then some of {list(VARIANTS)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.runtime_options = {}
    if args.tiny:
        args.model, args.steps, args.repeats, args.num_seqs, args.max_len = (
            "tiny-llama-3", 4, 1, 4, 110)
        args.quality_tokens, args.dtype = 64, "float32"
        args.runtime_options = {"max_total_tokens": 2048, "dtype": "float32"}
    if args.attention_backend is not None:
        args.runtime_options["attention_backend"] = args.attention_backend
    results: dict[str, Any] = {"environment": environment(device),
                               "attention_backend": args.attention_backend or "default"}
    if args.fp8_gemv_table is not None:
        from bench.gemv import tuned_from_sweep
        from lmnb.runtime.kernels.fused import gemv_fp8

        gemv_fp8.TUNED.update(tuned_from_sweep(args.fp8_gemv_table))
        gemv_fp8.fp8_gemv_config.cache_clear()
        results["fp8_gemv_table"] = {str(key): tuple(config)
                                     for key, config in gemv_fp8.TUNED.items()}
        print(f"gemv_fp8 configs from {args.fp8_gemv_table}: {results['fp8_gemv_table']}")
    speed = run_speed(args, device, parts) if parts & {"decode", "offline"} else {}
    if speed:
        results["speed"] = speed
        rows = [[name, *(speed[name].get(key) for key in (
            "weight_gb", "decode_ms_per_step", "decode_tok_s", "fraction_of_floor",
            "offline_tok_s", "kv_tokens"))] for name in args.variants]
        print(f"{speed['model']}, copy bandwidth {speed['copy_bandwidth_gbs']} GB/s")
        b = f"b{args.decode_batch[0]}"
        print(format_table(["variant", "weights GB", f"{b} ms/step", f"{b} tok/s", "of floor",
                            "offline tok/s", "KV tokens"], rows))
        if len(args.decode_batch) > 1 and "decode" in parts:
            print(format_table(["variant", *(f"b{batch} ms/step" for batch in args.decode_batch)],
                               [[name, *(speed[name]["decode_by_batch"][batch]
                                         ["decode_ms_per_step"] for batch in args.decode_batch)]
                                for name in args.variants]))
        results["ratios"] = _ratios(speed)
        for key, value in results["ratios"].items():
            print(f"{key}: {value:.3f}")
    if "quality" in parts:
        quality = run_quality(args, device)
        results["quality"] = quality
        print(f"quality on {quality['text']}")
        ref = quality[quality["rows"][0]]
        print("positions whose bf16 top-1 beats top-2 by <= m (logprob): " + ", ".join(
            f"m={m}: {ref[f'positions_margin_below_{m}']:.1%}" for m in MARGINS))
        print(format_table(
            ["variant", "positions", "perplexity", "vs bf16", "top-1 agreement",
             *(f"agreement, margin > {m}" for m in MARGINS)],
            [[name, quality[name]["positions"], quality[name]["perplexity"],
              quality[name].get("perplexity_vs_bf16"), quality[name].get("top1_agreement"),
              *(quality[name].get(f"top1_agreement_margin_{m}") for m in MARGINS)]
             for name in quality["rows"]]))
    if "w8a16" in parts:
        if device.type != "cuda":
            parser.error("--parts w8a16 times CUDA kernels")
        w8a16 = run_w8a16(device)
        results["w8a16"] = w8a16
        print("Llama-3-8B's qkv + o + gate_up + down, bf16 activations, ms (median of 10):")
        print(format_table(["rows", "bf16", "W8A8 _scaled_mm", "W8A16 mm_fp8", "W8A16 dequant"],
                           [[m, r["bf16"], r["w8a8"], r["w8a16_kernel"], r["w8a16_dequant"]]
                            for m, r in w8a16.items()]))
    path = write_results(RESULTS_DIR / ("fp8_tiny.json" if args.tiny else "fp8.json"), results)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
