"""FP8 options (no torch): `quantization` and `kv_cache_dtype` under SGLang's names, and the
`quantization_config` of pre-quantized `compressed-tensors` checkpoints.

    quantization=None           the checkpoint as it is (a compressed-tensors FP8 checkpoint is
                                recognised from its config.json, as SGLang does)
    quantization="fp8"          16/32-bit weights quantized at load to float8_e4m3fn, one scale
                                per output channel; an FP8 checkpoint is loaded as it is
    quantization="compressed-tensors"   the checkpoint must be an FP8 compressed-tensors one

    kv_cache_dtype="auto"       the KV pool in the model's dtype
    kv_cache_dtype="fp8_e4m3"   the KV pool in float8_e4m3fn with a float32 scale per token and
                                KV head (memory/kv_storage.py): ~half the bytes per token; with
                                attention_backend="flashinfer" one fixed scale per layer for K
                                and one for V, as FlashInfer reads FP8 KV: the checkpoint's
                                (compressed-tensors `kv_cache_scheme`), else 1.0
    kv_cache_dtype="bf16"/"bfloat16"    bfloat16 whatever the model's dtype

What FP8 covers: the decoder's linear layers (q/k/v, o, gate/up, down), in every Llama-family model
and LLaVA's language model; embeddings, the LM head, norms and the vision tower keep the model's
dtype. Activations are quantized per token at run time (dynamic, W8A8), so a checkpoint's static
`input_scale` tensors are checked and not used. A compressed-tensors checkpoint whose config groups
have no `input_activations` is weight-only FP8 (W8A16, vLLM's `CompressedTensorsW8A16Fp8`): the
activations stay 16-bit in every GEMM (the skinny GEMV at M <= 16 always runs so; larger M
multiply the dequantized weight in the model's dtype instead of `_scaled_mm`).
`bench/fp8_gptq.py` writes such a checkpoint with GPTQ rounding: the best FP8 weight scheme on
SmolLM2-135M's quality study (bench/RESULTS.md: >= 95% top-1 agreement with bf16 when calibrated
on text like the evaluated one, about 94% on unrelated calibration text).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

QUANTIZATION_METHODS = ("fp8", "compressed-tensors")
KV_CACHE_DTYPES = {"auto": "auto", "fp8_e4m3": "float8_e4m3fn", "bf16": "bfloat16",
                   "bfloat16": "bfloat16"}


class UnsupportedQuantizationError(ValueError):
    """A checkpoint's `quantization_config` or a quantization option lmnb cannot serve."""


@dataclass(frozen=True, slots=True)
class Fp8Config:
    """FP8 (e4m3) weights of the decoder's linears with per-output-channel scales in memory.

    `prequantized`: the checkpoint holds FP8 weights and their `weight_scale` (compressed-tensors;
    per channel or per tensor, which becomes per channel); else 16/32-bit weights are quantized
    while they load. `ignored`: the checkpoint's `ignore` list (modules it left unquantized);
    `targets`: its config groups' targets (the modules it quantized; empty: every linear)."""

    prequantized: bool = False
    weight_strategy: str = "channel"  # the checkpoint's: 'channel' | 'tensor'
    static_input_scale: bool = False  # the checkpoint has `input_scale` tensors (not used)
    ignored: tuple[str, ...] = ()
    targets: tuple[str, ...] = ()
    weight_only: bool = False  # W8A16: activations stay 16-bit (no `input_activations`)

    def quantizes(self, module: str) -> bool:
        """Whether decoder linear `module` (named as in a Llama checkpoint without its prefix:
        'layers.3.mlp.down_proj') is FP8, i.e. matched by one of the checkpoint's `targets`
        (when it has any) and by no entry of its `ignore` list. Entries are full names, 're:'
        regular expressions or, among targets, a class name ('Linear'), written for the decoder
        under any of its checkpoint names (`DECODER_PREFIXES`: Llama's, or LLaVA's language
        model's); a regular expression matches from the name's start (`re.match`, as
        compressed-tensors and vLLM match: 're:model.layers.0.mlp' ignores that layer's MLP
        linears). An entry naming another module with the same tail (the vision tower's
        'layers.3.self_attn.q_proj') is not the decoder's."""
        names = [prefix + module for prefix in DECODER_PREFIXES]
        if self.targets and not any(_names_match(t, names) or t.lower() == _LINEAR_CLASS
                                    for t in self.targets):
            return False
        return not any(_names_match(entry, names) for entry in self.ignored)


_LINEAR_CLASS = "linear"  # a target naming the class of the modules (torch's `Linear`)


def _names_match(entry: str, names: list[str]) -> bool:
    if entry.startswith("re:"):
        pattern = re.compile(entry[3:])
        return any(pattern.match(name) for name in names)
    return entry in names


# LLaVA's decoder in its checkpoints: the llava-hf hub's layout (transformers < 4.52) and after
# (`LlavaForConditionalGeneration` moved the language model under `model.`); models/llava.py
# loads both.
LLAVA_DECODER_PREFIXES = ("language_model.model.", "model.language_model.")
# The decoder's module names in checkpoints: bare, Llama's, LLaVA's.
DECODER_PREFIXES = ("", "model.", *LLAVA_DECODER_PREFIXES)


def module_quantization(quant: Fp8Config | None, modules: list[str]) -> Fp8Config | None:
    """The FP8 config of one linear made of checkpoint `modules` (q/k/v or gate/up fused):
    None where the checkpoint leaves them 16-bit (`Fp8Config.quantizes`); an error where it
    leaves only some of them (a fused weight has one format)."""
    if quant is None:
        return None
    kept = {quant.quantizes(m) for m in modules}
    if len(kept) > 1:
        raise UnsupportedQuantizationError(
            f"the checkpoint's targets or ignore list leave only some of {modules} unquantized; "
            "lmnb fuses them into one FP8 or 16-bit weight")
    return quant if kept == {True} else None


def checkpoint_quantization(quantization_config: Mapping[str, Any] | None) -> Fp8Config | None:
    """The `Fp8Config` of a config.json's `quantization_config` (None: none there);
    UnsupportedQuantizationError for any other method or scheme."""
    if quantization_config is None:
        return None
    method = str(quantization_config.get("quant_method", "")).replace("_", "-")
    if method != "compressed-tensors":
        raise UnsupportedQuantizationError(
            f"checkpoint quantization {method or quantization_config!r} is not supported; lmnb "
            "loads FP8 compressed-tensors checkpoints or quantizes 16-bit ones itself "
            "(quantization='fp8')")
    groups = quantization_config.get("config_groups") or {}
    if not groups:
        raise UnsupportedQuantizationError("compressed-tensors quantization_config has no "
                                           "config_groups")
    strategies, static, with_inputs, targets = set(), False, set(), []
    for name, group in groups.items():
        targets.extend(str(t) for t in group.get("targets") or ())
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise UnsupportedQuantizationError(
                f"compressed-tensors group {name!r}: weights {weights!r} are not FP8 (8-bit "
                "float); only FP8 schemes are supported")
        strategy = weights.get("strategy")
        if strategy not in ("channel", "tensor"):
            raise UnsupportedQuantizationError(
                f"compressed-tensors group {name!r}: weight strategy {strategy!r}; supported: "
                "'channel', 'tensor'")
        if weights.get("dynamic"):
            raise UnsupportedQuantizationError(f"compressed-tensors group {name!r}: dynamic "
                                               "weight quantization is not supported")
        strategies.add(strategy)
        inputs = group.get("input_activations") or {}
        with_inputs.add(bool(inputs))
        if inputs and (inputs.get("type") != "float" or inputs.get("num_bits") != 8):
            raise UnsupportedQuantizationError(
                f"compressed-tensors group {name!r}: input activations {inputs!r} are not FP8")
        static = static or bool(inputs) and not inputs.get("dynamic", False)
    if len(with_inputs) > 1:
        raise UnsupportedQuantizationError(
            "compressed-tensors config_groups mix weight-only FP8 with FP8 activations; lmnb "
            "runs one scheme for every linear")
    check_kv_cache_scheme(quantization_config.get("kv_cache_scheme"))
    ignored = tuple(str(n) for n in quantization_config.get("ignore") or ())
    return Fp8Config(prequantized=True,
                     weight_strategy="tensor" if "tensor" in strategies else "channel",
                     static_input_scale=static, ignored=ignored, targets=tuple(targets),
                     weight_only=with_inputs == {False})


def check_kv_cache_scheme(scheme: Mapping[str, Any] | None) -> None:
    """A compressed-tensors `kv_cache_scheme` lmnb can read: FP8, one static symmetric scale per
    tensor for K and one for V (`self_attn.k_scale` / `v_scale`); else
    UnsupportedQuantizationError. Its scales serve a pool of fixed scales (FlashInfer's); a pool
    of per-token scales computes its own."""
    if not scheme:
        return
    if scheme.get("type") != "float" or scheme.get("num_bits") != 8:
        raise UnsupportedQuantizationError(f"kv_cache_scheme {dict(scheme)!r} is not FP8 (8-bit "
                                           "float)")
    if scheme.get("strategy") != "tensor" or scheme.get("dynamic") or not scheme.get(
            "symmetric", True):
        raise UnsupportedQuantizationError(
            f"kv_cache_scheme {dict(scheme)!r}: lmnb reads static symmetric per-tensor KV scales "
            "(strategy 'tensor')")


def resolve_quantization(option: str | None, checkpoint: Fp8Config | None) -> Fp8Config | None:
    """What the model is built with, from `Runtime(quantization=...)` and the checkpoint's own."""
    if option is None:
        return checkpoint
    if option not in QUANTIZATION_METHODS:
        raise UnsupportedQuantizationError(
            f"unknown quantization {option!r}; choose one of: {', '.join(QUANTIZATION_METHODS)}")
    if checkpoint is not None:
        return checkpoint
    if option == "compressed-tensors":
        raise UnsupportedQuantizationError(
            "quantization='compressed-tensors' needs a checkpoint whose config.json has a "
            "compressed-tensors quantization_config; use quantization='fp8' to quantize a 16-bit "
            "checkpoint at load")
    return Fp8Config()


def kv_cache_dtype_name(option: str) -> str:
    """'auto' or the torch dtype name of the KV pool for `kv_cache_dtype`."""
    if option not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {option!r} is not supported; choose one of: "
                         f"{', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[option]
