"""The tokenizer class `AutoTokenizer.from_pretrained(folder)` builds, told from the folder's JSON
files alone where that can be told.

AutoTokenizer reads the folder's config with AutoConfig to choose a class, which imports the
model's configuration module and, through transformers' type validators, its image and video
utilities (torchvision where installed): seconds of an engine's start. For a folder with a
tokenizer.json, a `tokenizer_class` in tokenizer_config.json and no remote code (`auto_map`),
its choice is:
- Qwen2's own class for a `qwen2` config.json, whatever class tokenizer_config.json names
  (transformers lists Qwen2 among the models whose hub tokenizer class is wrong);
- the generic fast tokenizer (`PreTrainedTokenizerFast`, transformers 5's `TokenizersBackend`)
  when tokenizer_config.json names that class and the model type registers no tokenizer class of
  its own (Llama, the LLaVA family, or a folder without config.json).
tests/test_tokenizer_choice.py checks these facts in transformers' `TOKENIZER_MAPPING_NAMES`,
and that both ways give the same tokenizer. They hold from transformers 5 (4.x builds
`Qwen2TokenizerFast` for Qwen2): with an older transformers, and for anything else, AutoTokenizer.
"""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path
from typing import Any

GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
# Model types whose tokenizer AutoTokenizer takes from tokenizer_config.json's class (None: a
# folder without config.json). Not Mistral's (mistral-common's backend where it is installed).
GENERIC_MODEL_TYPES = frozenset({None, "llama", "llava", "llava_next", "llava_next_video"})
QWEN2 = "qwen2"


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def class_name(folder: Path) -> str | None:
    """'PreTrainedTokenizerFast' or 'Qwen2Tokenizer' when AutoTokenizer would build that class
    from `folder` (see the module doc); None when only AutoTokenizer can tell."""
    folder = Path(folder)
    if int(version("transformers").split(".")[0]) < 5 or not (folder / "tokenizer.json").is_file():
        return None
    tokenizer_config = _read_json(folder / "tokenizer_config.json")
    if tokenizer_config is None or "auto_map" in tokenizer_config:
        return None
    named = tokenizer_config.get("tokenizer_class")
    if not isinstance(named, str) or not named:
        return None
    model_type: Any = None
    if (folder / "config.json").exists():
        config = _read_json(folder / "config.json")
        if config is None or config.get("model_type") is None:
            return None
        model_type = config["model_type"]
    if model_type == QWEN2:
        return "Qwen2Tokenizer"
    if named in GENERIC_CLASSES and model_type in GENERIC_MODEL_TYPES:
        return "PreTrainedTokenizerFast"
    return None


def tokenizer_class(folder: Path) -> type | None:
    """The class of `class_name(folder)`, imported without transformers' config classes."""
    name = class_name(folder)
    if name == "Qwen2Tokenizer":
        from transformers import Qwen2Tokenizer

        return Qwen2Tokenizer
    if name == "PreTrainedTokenizerFast":
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast
    return None
