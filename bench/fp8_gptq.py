"""Write an FP8 compressed-tensors checkpoint of a Llama-family model, rounded by GPTQ.

The checkpoint is what `llm-compressor` writes for an FP8 scheme (`config_groups` with float 8-bit
weights, `strategy: channel`, `weight_scale` [N, 1] float32 beside each FP8 weight, `ignore`), so
lmnb (and vLLM / SGLang) load it as they are:

    --activations none      weight-only FP8 (W8A16: no `input_activations` group; vLLM's
                            `CompressedTensorsW8A16Fp8`), with GPTQ the best FP8 weight scheme on
                            SmolLM2-135M (bench/RESULTS.md; its agreement depends on the
                            calibration text)
    --activations dynamic   W8A8: activations per token at run time (`FP8_DYNAMIC`)
    --rtn                   round to nearest (what `quantization="fp8"` does at load) instead

GPTQ keeps each row's scale (amax / 448) and picks the FP8 values column by column, feeding each
column's rounding error to the columns not yet rounded through the inverse Hessian of the layer's
inputs (those of the 16-bit model, in float32) on calibration text
(`bench/fp8_sensitivity.gptq_weight`). Calibration: `--calib-tokens` tokens of
bench/data/opticks.txt from `--calib-start` (past the 4,096 tokens bench/fp8.py measures), or of
any `--calib-text` file (your own data).
Scope: Llama-family checkpoints in one `model.safetensors` with plain rotary (the calibration
forward is bench/fp8_sensitivity.py's plain-torch Llama; rope scaling is not modelled there).

    python bench/fp8_gptq.py --out /tmp/smollm2-fp8-gptq            # the embedded SmolLM2
    python bench/fp8_gptq.py --model DIR --out DIR2 --activations dynamic
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fp8_sensitivity import (  # noqa: E402
    FP8,
    FP8_MAX,
    TEXT,
    Scheme,
    SmolLM,
    gptq_weight,
    quant_weight,
)
from lmnb.runtime.models.loader import load_tokenizer, resolve_model_dir  # noqa: E402

LINEAR_NAMES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
                "down": "mlp.down_proj"}


def quantization_config(*, weight_only: bool, ignore: list[str]) -> dict:
    group: dict = {"targets": ["Linear"],
                   "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                               "dynamic": False, "symmetric": True}}
    if not weight_only:
        group["input_activations"] = {"num_bits": 8, "type": "float", "strategy": "token",
                                      "dynamic": True, "symmetric": True}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": group}, "ignore": ["lm_head", *ignore]}


def calibration_ids(folder: Path, start: int, tokens: int,
                    text_file: Path | None = None) -> torch.Tensor:
    """`tokens` token ids of `text_file` (default: bench/data/opticks.txt) from token `start`."""
    text = (TEXT.read_text().split("\n", 2)[2] if text_file is None  # as bench/fp8.py's
            else text_file.read_text())
    ids = load_tokenizer(folder).encode(text)[start:][:tokens]
    if not ids:
        raise ValueError(f"no calibration text past token {start}")
    return torch.tensor(ids)


@torch.no_grad()
def write_fp8_checkpoint(source: Path, target: Path, *, weight_only: bool = True,
                         gptq: bool = True, calib: torch.Tensor | None = None,
                         skip_layers: tuple[int, ...] = ()) -> Path:
    """`source` (an HF folder with one model.safetensors) -> `target`, its decoder linears FP8
    with per-channel scales (GPTQ-rounded on `calib` token ids when `gptq`), layers in
    `skip_layers` left 16-bit and listed in `ignore`."""
    from safetensors.torch import load_file, save_file

    if not (source / "model.safetensors").is_file():
        raise ValueError(f"{source}: needs one model.safetensors (sharded checkpoints are not "
                         "supported by this script)")
    model = SmolLM(source)
    if gptq:
        assert calib is not None, "GPTQ needs calibration token ids"
        model.collect = True
        model.logprobs(calib, Scheme("calibration"), torch.float32)
        model.collect = False
    raw = load_file(str(source / "model.safetensors"))
    ignore: list[str] = []
    for layer in range(model.layers):
        for short, full in LINEAR_NAMES.items():
            name = f"model.layers.{layer}.{full}"
            if layer in skip_layers:
                ignore.append(name)
                continue
            w = raw[name + ".weight"].float()
            scale = (w.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
            q = (gptq_weight(w, model.hessians[(layer, short)], "channel") if gptq
                 else quant_weight(w, "channel"))
            raw[name + ".weight"] = (q / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            raw[name + ".weight_scale"] = scale
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for file in source.iterdir():
        if file.is_file() and not file.name.endswith(".safetensors"):
            shutil.copy(file, target / file.name)
    save_file(raw, str(target / "model.safetensors"))
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = quantization_config(weight_only=weight_only, ignore=ignore)
    (target / "config.json").write_text(json.dumps(config, indent=1))
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="HF folder (default: the embedded SmolLM2, converted)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--activations", choices=("none", "dynamic"), default="none")
    parser.add_argument("--rtn", action="store_true", help="round to nearest, no GPTQ")
    parser.add_argument("--skip-layers", default="", help="e.g. 0,29: left 16-bit")
    parser.add_argument("--calib-start", type=int, default=None,
                        help="first calibration token (default: 4096 of opticks.txt, 0 of "
                             "--calib-text)")
    parser.add_argument("--calib-tokens", type=int, default=1024)
    parser.add_argument("--calib-text", type=Path, default=None,
                        help="calibrate on this text file (from --calib-start, default 0 then)")
    args = parser.parse_args()
    model = args.model or resolve_model_dir(None)
    skip = tuple(int(i) for i in args.skip_layers.split(",") if i)
    start = args.calib_start if args.calib_start is not None else (
        4096 if args.calib_text is None else 0)
    calib = None if args.rtn else calibration_ids(model, start, args.calib_tokens, args.calib_text)
    out = write_fp8_checkpoint(model, args.out, weight_only=args.activations == "none",
                               gptq=not args.rtn, calib=calib, skip_layers=skip)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
