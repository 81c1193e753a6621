"""`loader.load_tokenizer` builds the tokenizer AutoTokenizer builds (same class, ids, special
tokens, chat template output) without importing transformers' config classes, and an engine's
start imports none of them, nor transformers' image utilities or torchvision."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lmnb.runtime.models import loader, tokenizer_choice

TEXTS = ["Hello world, héllo wörld! 123 +-*/ 日本語 🙂",
         "<|im_start|>user\nhi<|im_end|>\n<image> <video> <|endoftext|>  trailing  spaces  "]
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"}]


def _bare_tokenizer_folder(root: Path, source: Path) -> Path:
    """The tokenizer files of `source` alone (a `--tokenizer` folder without config.json)."""
    folder = root / "bare-tokenizer"
    folder.mkdir()
    for file in source.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(file, folder / file.name)
    return folder


def _signature(tokenizer: Any) -> dict[str, Any]:
    # a tokenizer folder may ship without a template ($LMNB_TOKENIZER_DIR on the GPU machine):
    # then both must lack it, and there is no chat output to compare
    chatting = tokenizer.chat_template is not None
    return {
        "class": type(tokenizer),
        "len": len(tokenizer),
        "special": tokenizer.special_tokens_map,
        "special_ids": tokenizer.all_special_ids,
        "added": {i: str(t) for i, t in tokenizer.added_tokens_decoder.items()},
        "ids": [tokenizer(text).input_ids for text in TEXTS],
        "decoded": [tokenizer.decode(tokenizer(text).input_ids) for text in TEXTS],
        "template": tokenizer.chat_template,
        "chat": [tokenizer.apply_chat_template(MESSAGES, tokenize=False,
                                               add_generation_prompt=prompt)
                 for prompt in (False, True)] if chatting else None,
        "chat_ids": (tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
                     if chatting else None),
    }


def test_what_transformers_registers_for_the_model_types() -> None:
    """tokenizer_choice's generic model types register no tokenizer class of their own (or the
    generic one): AutoTokenizer then builds the class tokenizer_config.json names; Qwen2's class
    replaces whatever a qwen2 folder names."""
    from transformers.models.auto.tokenization_auto import (
        MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS,
        TOKENIZER_MAPPING_NAMES,
    )

    for model_type in tokenizer_choice.GENERIC_MODEL_TYPES - {None}:
        assert TOKENIZER_MAPPING_NAMES.get(model_type) in (None, "TokenizersBackend"), model_type
    assert TOKENIZER_MAPPING_NAMES[tokenizer_choice.QWEN2] == "Qwen2Tokenizer"
    assert tokenizer_choice.QWEN2 in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS


def test_load_tokenizer_equals_autotokenizer(tmp_path: Path, smollm2_dir: Path,
                                             tiny_models: dict[str, Path],
                                             tiny_llavas: dict[str, Path]) -> None:
    """The embedded tokenizer with a Llama config.json, alone (a `tokenizer_path` folder), with
    LLaVA-NeXT-Video's added `<image>`/`<video>` tokens, and with a Qwen2 config.json."""
    from transformers import AutoTokenizer

    assert tokenizer_choice.class_name(tiny_models["mistral"]) is None  # AutoTokenizer's way
    for folder, name in ((tiny_models["llama-gqa"], "PreTrainedTokenizerFast"),
                         (_bare_tokenizer_folder(tmp_path, smollm2_dir),
                          "PreTrainedTokenizerFast"),
                         (tiny_llavas["llava-next-video"], "PreTrainedTokenizerFast"),
                         (tiny_models["qwen2-bias"], "Qwen2Tokenizer")):
        assert tokenizer_choice.class_name(folder) == name, folder
        expected = _signature(AutoTokenizer.from_pretrained(folder, local_files_only=True))
        assert _signature(loader.load_tokenizer(folder)) == expected, folder


def test_remote_code_and_other_classes_go_through_autotokenizer(tmp_path: Path,
                                                                smollm2_dir: Path) -> None:
    folder = _bare_tokenizer_folder(tmp_path, smollm2_dir)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    assert tokenizer_choice.class_name(folder) == "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps({**config, "auto_map": {"AutoTokenizer": ["a.B", None]}}))
    assert tokenizer_choice.class_name(folder) is None
    config_file.write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizer"}))
    assert tokenizer_choice.class_name(folder) is None
    config_file.write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}))
    assert tokenizer_choice.class_name(folder) == "PreTrainedTokenizerFast"
    for model_type, name in (("mistral", None), ("qwen2", "Qwen2Tokenizer"), ("gemma", None),
                             ("llava_next", "PreTrainedTokenizerFast")):
        (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
        assert tokenizer_choice.class_name(folder) == name, model_type
    (folder / "tokenizer.json").unlink()
    assert tokenizer_choice.class_name(folder) is None


def test_a_tokenizer_only_folder_is_a_tokenizer_path(tmp_path: Path, smollm2_dir: Path,
                                                    tiny_models: dict[str, Path]) -> None:
    """A `tokenizer_path` folder needs no config.json (bench/fetch_tokenizers.sh writes such);
    a model folder still resolves as before, a folder with neither is the loader's error."""
    from bench.dummy_models import write_dummy_model
    from lmnb.runtime.engine import Runtime

    bare = _bare_tokenizer_folder(tmp_path, smollm2_dir)
    assert loader.resolve_tokenizer_dir(bare) == bare
    assert loader.resolve_tokenizer_dir(smollm2_dir) == smollm2_dir
    assert loader.resolve_tokenizer_dir(None) == loader.resolve_model_dir(None)  # embedded
    (tmp_path / "empty").mkdir()
    with pytest.raises(loader.ModelNotFoundError):
        loader.resolve_tokenizer_dir(tmp_path / "empty")

    assert write_dummy_model("llama-3-8b", tmp_path / "dummy", bare).tokenizer_path == bare
    runtime = Runtime(str(tiny_models["llama-gqa"]), device="cpu", max_total_tokens=256,
                      tokenizer_path=str(bare))
    try:
        assert runtime.tokenizer.encode(TEXTS[0]) == loader.load_tokenizer(smollm2_dir).encode(
            TEXTS[0])
    finally:
        runtime.shutdown()


# Run in a fresh interpreter: an engine's start over the tiny Llama, with a stand-in torchvision
# installed (transformers then believes torchvision is available, as on the GPU machine, and
# its config classes' type validators import it).
_START = """
import sys
from lmnb.runtime.engine import Runtime

runtime = Runtime(sys.argv[1], device="cpu", max_total_tokens=256)
runtime.shutdown()
heavy = sorted(name for name in sys.modules
               if name in ("torchvision", "transformers.image_utils", "transformers.video_utils")
               or name.startswith("transformers.models.") and ".configuration_" in name
               or name == "transformers.configuration_utils")
print("HEAVY", heavy)
"""


def test_engine_start_imports_no_config_classes_nor_image_utils(
        tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    fake = tmp_path / "site"
    (fake / "torchvision").mkdir(parents=True)
    (fake / "torchvision" / "__init__.py").write_text('__version__ = "0.99.0"\n')
    (fake / "torchvision-0.99.0.dist-info").mkdir()
    (fake / "torchvision-0.99.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torchvision\nVersion: 0.99.0\n")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root), str(fake), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    result = subprocess.run([sys.executable, "-c", _START, str(tiny_models["llama-gqa"])],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "HEAVY []" in result.stdout, result.stdout
