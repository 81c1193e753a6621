"""EngineConfig validation and ModelConfig normalisation of real HF configs (built in code)."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, LlamaConfig, LlavaConfig, PretrainedConfig

from lmnb.runtime.config import EngineConfig, ModelConfig

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             vocab_size=1000, max_position_embeddings=256)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def test_engine_config_defaults_are_sglang_names_and_plain_data() -> None:
    config = EngineConfig()
    assert (config.schedule_policy, config.load_format, config.dtype, config.device) == (
        "lpm", "auto", "auto", "auto")
    assert (config.tp_size, config.dp_size, config.disable_cuda_graph) == (1, 1, False)
    assert pickle.loads(pickle.dumps(config)) == config
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_total_tokens = 5  # type: ignore[misc]


def test_engine_config_normalises_paths_dtypes_and_devices() -> None:
    config = EngineConfig(model_path=Path("/tmp/m"), dtype=torch.bfloat16,
                          device=torch.device("cuda", 1))
    assert (config.model_path, config.dtype, config.device) == ("/tmp/m", "bfloat16", "cuda:1")
    assert EngineConfig(dtype="FP16").dtype == "float16"
    assert EngineConfig(dtype="AUTO").dtype == "auto"


@pytest.mark.parametrize(("options", "message"), [
    ({"schedule_policy": "fastest"}, "unknown schedule_policy 'fastest'"),
    ({"load_format": "gguf"}, "unknown load_format 'gguf'; choose one of: auto, dummy"),
    ({"dtype": "float8"}, "unknown dtype 'float8'"),
    ({"dtype": torch.int32}, "floating point"),
    ({"device": "tpu"}, "device must be"),
    ({"mem_fraction_static": 0.0}, r"mem_fraction_static must be in \(0, 1\], got 0.0"),
    ({"mem_fraction_static": 1.5}, "mem_fraction_static must be in"),
    ({"mem_fraction_static": True}, "mem_fraction_static must be in"),
    ({"max_total_tokens": 1}, "max_total_tokens must be >= 2, got 1"),
    ({"max_total_tokens": 1024.0}, "max_total_tokens must be an int or None"),
    ({"max_running_requests": 0}, "max_running_requests must be >= 1"),
    ({"context_length": -5}, "context_length must be >= 2"),
    ({"chunked_prefill_size": 0}, "chunked_prefill_size must be >= 1"),
    ({"schedule_conservativeness": -0.5}, "schedule_conservativeness must be a number >= 0"),
    ({"schedule_conservativeness": "low"}, "schedule_conservativeness must be a number"),
    ({"cuda_graph_max_bs": 0}, "cuda_graph_max_bs must be >= 1"),
    ({"random_seed": -1}, "random_seed must be >= 0"),
    ({"tp_size": 0}, "tp_size must be >= 1, got 0"),
    ({"dp_size": 0}, "dp_size must be >= 1"),
    ({"tp_size": None}, "tp_size must be an int, got None"),
    ({"disable_radix_cache": "yes"}, "disable_radix_cache must be True or False"),
    ({"disable_cuda_graph": 1}, "disable_cuda_graph must be True or False"),
    ({"attention_backend": ""}, "attention_backend must be a backend name"),
    ({"model_path": 3}, "model_path must be a path"),
])
def test_engine_config_rejects_bad_values(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


def test_unknown_option_is_named_with_the_known_ones() -> None:
    with pytest.raises(TypeError, match="unknown Runtime option.*: max_tokens, radix") as info:
        EngineConfig.from_options(max_tokens=3, radix=False)
    assert "max_total_tokens" in str(info.value) and "schedule_policy" in str(info.value)
    assert EngineConfig.from_options(max_total_tokens=64).max_total_tokens == 64


def test_runtime_rejects_unknown_options_before_loading() -> None:
    from lmnb.runtime.engine import Runtime

    with pytest.raises(TypeError, match="unknown Runtime option.*: max_tokens"):
        Runtime("/nonexistent/model", max_tokens=3)
    with pytest.raises(ValueError, match="unknown schedule_policy"):
        Runtime("/nonexistent/model", schedule_policy="nope")


def test_model_config_llama_mha() -> None:
    hf = AutoConfig.for_model("llama", **SMALL, bos_token_id=1, eos_token_id=2,
                              rms_norm_eps=1e-5, dtype="bfloat16")
    config = ModelConfig.from_hf(hf.to_dict())
    assert (config.model_type, config.num_layers, config.hidden_size) == ("llama", 3, 64)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 4, 16)
    assert (config.intermediate_size, config.vocab_size, config.context_length) == (128, 1000, 256)
    assert (config.rope_theta, config.rope_scaling, config.rms_norm_eps) == (10000.0, None, 1e-5)
    assert (config.bos_token_id, config.eos_token_ids, config.dtype) == (1, (2,), "bfloat16")
    assert not (config.qkv_bias or config.o_bias or config.mlp_bias or config.tie_word_embeddings)
    assert not config.is_multimodal and config.hidden_act == "silu"


def test_model_config_llama_gqa_with_attention_bias_and_tied_embeddings() -> None:
    hf = LlamaConfig(**SMALL, num_key_value_heads=2, attention_bias=True,
                     tie_word_embeddings=True, architectures=["LlamaForCausalLM"])
    config = ModelConfig.from_hf(hf.to_dict())
    assert (config.architecture, config.num_kv_heads, config.head_dim) == (
        "LlamaForCausalLM", 2, 16)
    assert config.qkv_bias and config.o_bias and config.tie_word_embeddings


def test_model_config_qwen2_has_qkv_bias_only() -> None:
    hf = AutoConfig.for_model("qwen2", **SMALL, num_key_value_heads=2, eos_token_id=[5, 7],
                              rope_theta=1000000.0)
    config = ModelConfig.from_hf(hf.to_dict())
    assert (config.model_type, config.qkv_bias, config.o_bias) == ("qwen2", True, False)
    assert (config.eos_token_ids, config.rope_theta) == ((5, 7), 1000000.0)


def test_model_config_mistral_with_explicit_head_dim() -> None:
    hf = AutoConfig.for_model("mistral", **SMALL, num_key_value_heads=1, head_dim=32,
                              sliding_window=None)
    config = ModelConfig.from_hf(hf.to_dict())
    assert (config.model_type, config.num_kv_heads, config.head_dim) == ("mistral", 1, 32)
    assert not config.qkv_bias


def test_model_config_llama3_rope_scaling() -> None:
    hf = AutoConfig.for_model("llama", **SMALL, num_key_value_heads=2,
                              rope_scaling=dict(LLAMA3_ROPE), rope_theta=500000.0)
    config = ModelConfig.from_hf(hf.to_dict())
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == LLAMA3_ROPE  # rope_type kept, theta lifted out


def test_model_config_llava_reads_the_nested_text_config() -> None:
    text = LlamaConfig(**{**SMALL, "num_hidden_layers": 5}, num_key_value_heads=2,
                       eos_token_id=2, rope_scaling={"rope_type": "linear", "factor": 2.0})
    hf = LlavaConfig(text_config=text.to_dict(), image_token_index=999,
                     architectures=["LlavaForConditionalGeneration"])
    config = ModelConfig.from_hf(hf.to_dict())
    assert (config.architecture, config.model_type, config.text_model_type) == (
        "LlavaForConditionalGeneration", "llava", "llama")
    assert (config.num_layers, config.num_kv_heads, config.vocab_size) == (5, 2, 1000)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert (config.eos_token_ids, config.image_token_id, config.is_multimodal) == ((2,), 999, True)


def test_model_config_rejects_inconsistent_heads_and_non_decoders() -> None:
    with pytest.raises(ValueError, match="num_heads \\(4\\) must be a multiple of num_kv_heads"):
        ModelConfig.from_hf(LlamaConfig(**SMALL, num_key_value_heads=3).to_dict())
    with pytest.raises(ValueError, match="no num_attention_heads"):
        ModelConfig.from_hf(PretrainedConfig().to_dict())


def test_model_runner_sizes_its_pools_from_both_configs() -> None:
    from lmnb.runtime.model_runner import ModelRunner

    model_config = ModelConfig.from_hf(LlamaConfig(**SMALL, num_key_value_heads=2).to_dict())
    cpu = torch.device("cpu")

    def runner(**options: object) -> ModelRunner:
        return ModelRunner(None, model_config, EngineConfig(**options), device=cpu,
                           dtype=torch.float32, eos_token_ids={2})

    sized = runner(max_total_tokens=300, context_length=1000)
    assert (sized.max_total_tokens, sized.context_len) == (300, 256)
    assert sized.max_running_requests == 150
    assert sized.kv_storage.size == 300
    assert runner(max_total_tokens=100, max_running_requests=3).context_len == 100
    assert runner(max_total_tokens=300, context_length=64).context_len == 64
    assert runner(max_total_tokens=300, max_running_requests=3).max_running_requests == 3
    assert 2 <= runner().max_total_tokens <= 65536  # CPU default: capped share of free memory


def test_runtime_exposes_both_configs(tiny_models: dict[str, Path]) -> None:
    from lmnb.runtime.engine import Runtime

    with Runtime(tiny_models["llama-gqa"], max_total_tokens=256, device="cpu",
                 schedule_policy="fcfs") as rt:
        assert rt.engine_config.max_total_tokens == 256
        assert rt.engine_config.schedule_policy == "fcfs"
        assert rt.engine_config.model_path == str(tiny_models["llama-gqa"])
        assert (rt.model_config.num_kv_heads, rt.model_config.tie_word_embeddings) == (2, True)
        assert rt.context_len == 256 and rt.dtype == torch.float32
        assert 2 in rt.eos_token_ids
