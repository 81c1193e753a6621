"""FP8's quality schemes on the CPU: weight-only FP8 (W8A16) from compressed-tensors checkpoints
without `input_activations`, GPTQ rounding onto the per-channel FP8 grid (bench/fp8_gptq.py), and
the tie-aware top-1 agreement of the quality benchmarks."""

from __future__ import annotations

import json
import random

import pytest
import torch
from torch.nn import functional as F

from bench.fp8 import PromptScores, agreement_rows
from bench.fp8_gptq import calibration_ids, write_fp8_checkpoint
from bench.fp8_sensitivity import compare, fake_fp8, gptq_weight, quant_weight
from lmnb.runtime.models import loader
from lmnb.runtime.models.layers import fp8
from lmnb.runtime.quantization import (
    UnsupportedQuantizationError,
    checkpoint_quantization,
    module_quantization,
)
from tests.test_fp8 import _load, _passes, _runner

FP8 = torch.float8_e4m3fn


def _group(inputs: bool) -> dict:
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                "strategy": "channel", "dynamic": False}}
    if inputs:
        group["input_activations"] = {"num_bits": 8, "type": "float", "strategy": "token",
                                      "dynamic": True}
    return group


def test_checkpoints_without_input_activations_are_weight_only():
    def config(*groups: bool) -> dict:
        return {"quant_method": "compressed-tensors",
                "config_groups": {f"g{i}": _group(g) for i, g in enumerate(groups)}}

    assert checkpoint_quantization(config(False)).weight_only
    assert not checkpoint_quantization(config(True)).weight_only
    with pytest.raises(UnsupportedQuantizationError, match="mix weight-only"):
        checkpoint_quantization(config(True, False))
    quant = checkpoint_quantization(config(False) | {"ignore": [
        "lm_head", "model.layers.1.mlp.down_proj", "re:.*layers\\.2\\.self_attn\\.[qkv]_proj"]})
    assert not quant.quantizes("layers.1.mlp.down_proj")
    assert quant.quantizes("layers.11.mlp.down_proj") and quant.quantizes("layers.1.mlp.up_proj")
    assert module_quantization(quant, ["layers.2.self_attn.q_proj",
                                       "layers.2.self_attn.v_proj"]) is None
    assert module_quantization(quant, ["layers.3.self_attn.q_proj"]) is quant
    with pytest.raises(UnsupportedQuantizationError, match="only some"):
        module_quantization(quant, ["layers.1.mlp.up_proj", "layers.1.mlp.down_proj"])


def test_ignore_lists_written_for_llava_names_are_honoured():
    """A LLaVA checkpoint's `ignore` names the language model's linears under either
    transformers layout, and the vision tower's, whose names end as the decoder's do."""
    tower = [f"vision_tower.vision_model.encoder.layers.3.self_attn.{p}_proj" for p in "qkv"]
    quant = checkpoint_quantization({
        "quant_method": "compressed-tensors", "config_groups": {"g": _group(True)},
        "ignore": ["language_model.lm_head", "re:.*vision_tower.*", *tower,
                   "multi_modal_projector.linear_1", "language_model.model.layers.1.mlp.down_proj",
                   "re:language_model\\.model\\.layers\\.2\\.self_attn\\.[qkv]_proj",
                   "model.language_model.layers.4.mlp.down_proj",
                   "re:model\\.language_model\\.layers\\.5\\.mlp\\..*"]})
    assert not quant.quantizes("layers.1.mlp.down_proj")
    assert module_quantization(quant, [f"layers.2.self_attn.{p}_proj" for p in "qkv"]) is None
    assert module_quantization(quant, [f"layers.3.self_attn.{p}_proj" for p in "qkv"]) is quant
    assert not quant.quantizes("layers.4.mlp.down_proj")
    assert module_quantization(quant, ["layers.5.mlp.gate_proj", "layers.5.mlp.up_proj"]) is None
    assert quant.quantizes("layers.11.mlp.down_proj") and quant.quantizes("layers.1.mlp.up_proj")


def test_ignore_regexes_match_from_the_start_of_a_name(tiny_models, tmp_path):
    """compressed-tensors (and vLLM, SGLang) match an `ignore` 're:' entry with `re.match`: a
    prefix such as 're:model.layers.1' leaves every linear of layer 1 16-bit, and the loader keeps
    that layer's 16-bit weights as they are instead of quantizing them."""
    quant = checkpoint_quantization({"quant_method": "compressed-tensors",
                                     "config_groups": {"g": _group(False)},
                                     "ignore": ["lm_head", "re:model.layers.1"]})
    assert not quant.quantizes("layers.1.mlp.down_proj")
    assert quant.quantizes("layers.0.mlp.down_proj")
    _assert_layer_1_loads_unquantized(tiny_models, tmp_path, {
        "ignore": ["lm_head", "re:model.layers.1"]})


def test_only_the_linears_a_config_group_targets_are_fp8(tiny_models, tmp_path):
    """A compressed-tensors checkpoint quantizes only its config groups' `targets` (class names
    such as 'Linear', full names, 're:' expressions): the linears none of them names keep the
    checkpoint's 16-bit weights (they were quantized at load)."""
    group = {**_group(False), "targets": ["re:.*self_attn"]}
    quant = checkpoint_quantization({"quant_method": "compressed-tensors",
                                     "config_groups": {"g": group}})
    assert quant.quantizes("layers.0.self_attn.o_proj")
    assert not quant.quantizes("layers.0.mlp.down_proj")
    _assert_layer_1_loads_unquantized(tiny_models, tmp_path, {
        "ignore": ["lm_head"], "targets": ["re:model\\.layers\\.0\\."]})


def _assert_layer_1_loads_unquantized(tiny_models, tmp_path, edit: dict) -> None:
    """A checkpoint written with layer 1 left 16-bit, its quantization_config's `ignore` and
    (given) its group's `targets` set from `edit`: layer 0 loads FP8, layer 1 as written."""
    out = write_fp8_checkpoint(tiny_models["llama-gqa"], tmp_path / "fp8",
                               calib=torch.arange(3, 19), skip_layers=(1,))
    config_file = out / "config.json"
    config = json.loads(config_file.read_text())
    qc = config["quantization_config"]
    qc["ignore"] = edit["ignore"]
    if "targets" in edit:
        qc["config_groups"]["group_0"]["targets"] = edit["targets"]
    config_file.write_text(json.dumps(config))
    with pytest.warns(UserWarning, match="reference path"):
        model = _load(out, loader.load_model_config(out))
    assert model.model.layers[0].mlp.down_proj.weight.dtype == FP8
    kept = model.model.layers[1]
    assert kept.mlp.down_proj.weight_scale is None and kept.self_attn.qkv_proj.weight_scale is None
    assert kept.mlp.gate_up_proj.weight.dtype == torch.float32


def test_weight_only_linear_keeps_activations_16_bit():
    """W8A16 for many rows: the dequantized weight times the unquantized activations (not the
    W8A8 reference, whose per-token FP8 activations change the result)."""
    torch.manual_seed(0)
    w, x = torch.randn(48, 64), torch.randn(40, 64).to(torch.bfloat16)
    q, scale = fp8.quantize_rows(w)
    got = fp8.fp8_linear(x, q, scale, None, fused=False, weight_only=True)
    want = F.linear(x, fp8.dequantize_rows(q, scale, torch.bfloat16))
    assert torch.equal(got, want)
    w8a8 = fp8.fp8_linear(x, q, scale, None, fused=False)
    assert not torch.equal(w8a8, want)


def test_gptq_lowers_the_layer_output_error_on_its_calibration_inputs():
    """GPTQ's FP8 weights stay on each row's FP8 grid (same scales as round to nearest) and give
    a smaller ||X (W - Q)^T|| than rounding to nearest, on correlated inputs."""
    torch.manual_seed(0)
    w = torch.randn(32, 96)
    mix = torch.randn(96, 96) / 96 ** 0.5 + torch.eye(96)
    x = torch.randn(512, 96) @ mix  # correlated features, as a layer's inputs are
    hessian = (x.double().t() @ x.double())
    rtn, gptq = quant_weight(w, "channel"), gptq_weight(w, hessian, "channel")
    scale = w.abs().amax(-1, keepdim=True) / 448
    assert torch.equal(fake_fp8(gptq, scale), gptq)  # on the grid: exact FP8 values x scale
    assert not torch.equal(gptq, rtn)
    err = [(x @ (w - q).t()).norm().item() for q in (rtn, gptq)]
    assert err[1] < 0.8 * err[0]


def test_gptq_checkpoint_loads_weight_only(tiny_models, smollm2_dir, tmp_path):
    """bench/fp8_gptq.py on a tiny model: a compressed-tensors FP8 checkpoint (weight-only, one
    layer left 16-bit in `ignore`) that the loader takes as it is; its logits stay close to the
    16-bit model's."""
    folder = tiny_models["llama-gqa"]
    rng = random.Random(5)
    calib = torch.tensor([rng.randrange(3, 49152) for _ in range(64)])
    out = write_fp8_checkpoint(folder, tmp_path / "gptq", calib=calib, skip_layers=(1,))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "input_activations" not in qc["config_groups"]["group_0"]
    assert "model.layers.1.mlp.down_proj" in qc["ignore"]
    config = loader.load_model_config(out)
    assert config.quantization.weight_only
    with pytest.warns(UserWarning, match="reference path"):
        model = _load(out, config)
    down = model.model.layers[0].mlp.down_proj
    assert down.weight.dtype == FP8 and down.fp8_weight_only
    kept = model.model.layers[1]  # in `ignore`: its 16-bit weights as they are
    assert kept.mlp.down_proj.weight_scale is None and kept.self_attn.qkv_proj.weight_scale is None
    assert kept.mlp.down_proj.weight.dtype == torch.float32
    from safetensors.torch import load_file

    saved = load_file(str(out / "model.safetensors"))
    assert torch.equal(down.weight.view(torch.uint8),
                       saved["model.layers.0.mlp.down_proj.weight"].view(torch.uint8))
    base_config = loader.load_model_config(folder)
    prompts, next_ids = [[rng.randrange(3, 49152) for _ in range(9)]], [7]
    want = _passes(_runner(_load(folder, base_config), base_config), prompts, next_ids)
    got = _passes(_runner(model, config), prompts, next_ids)
    for w, g in zip(want, got, strict=True):
        assert 0 < (g - w).norm() / w.norm() < 0.15  # as W8A8 in tests/test_fp8.py
    assert calibration_ids(smollm2_dir, 4096, 16).numel() == 16


def test_agreement_counts_a_tie_at_the_top_for_either_token():
    ref = PromptScores(top1=[5, 6, 7], top2=[9, 8, 1], logprobs=[-1.0] * 3,
                       margins=[0.0, 0.5, 0.0])
    assert agreement_rows([9, 8, 7], ref)["top1_agreement"] == pytest.approx(2 / 3)
    logits = torch.tensor([[2.0, 2.0, 0.0], [0.0, 1.0, 3.0]])
    lp = torch.log_softmax(logits, -1)
    other = torch.log_softmax(torch.tensor([[1.0, 2.0, 0.0], [0.0, 3.0, 1.0]]), -1)
    assert compare(lp, other, torch.tensor([0, 2]), 0.1)["agree"] == 0.5
