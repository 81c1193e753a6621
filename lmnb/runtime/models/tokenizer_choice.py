"""Whether `AutoTokenizer.from_pretrained(folder)` builds transformers' generic fast tokenizer
(`PreTrainedTokenizerFast`, transformers 5's `TokenizersBackend`), told from the folder's JSON
files alone.

AutoTokenizer reads the folder's config with AutoConfig to choose a class, which imports the
model's configuration module and, through transformers' type validators, its image and video
utilities (torchvision where installed): seconds of an engine's start. Its choice is the generic
class when tokenizer_config.json names that class (`TokenizersBackend` or
`PreTrainedTokenizerFast`), maps no remote code (`auto_map`), and the model type (config.json's
`model_type`, or no config.json) registers no tokenizer class of its own in transformers'
`TOKENIZER_MAPPING_NAMES` (tests/test_tokenizer_choice.py checks that mapping, and that both
ways give the same tokenizer). Anything else goes through AutoTokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
# Model types whose tokenizer AutoTokenizer takes from tokenizer_config.json's class (None: a
# folder without config.json). Not Qwen2 (its own class) nor Mistral (mistral-common's backend).
GENERIC_MODEL_TYPES = frozenset({None, "llama", "llava", "llava_next", "llava_next_video"})


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_tokenizers_backend(folder: Path) -> bool:
    """True when AutoTokenizer would build the generic fast tokenizer from `folder`'s
    tokenizer.json (see the module doc)."""
    folder = Path(folder)
    if not (folder / "tokenizer.json").is_file():
        return False
    tokenizer_config = _read_json(folder / "tokenizer_config.json")
    if tokenizer_config is None or "auto_map" in tokenizer_config:
        return False
    if tokenizer_config.get("tokenizer_class") not in GENERIC_CLASSES:
        return False
    config_file = folder / "config.json"
    if not config_file.exists():
        return None in GENERIC_MODEL_TYPES
    config = _read_json(config_file)
    return config is not None and config.get("model_type") in GENERIC_MODEL_TYPES - {None}
