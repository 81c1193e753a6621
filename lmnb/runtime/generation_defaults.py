"""The sampling parameters a model recommends: those `generation_config.json` states, which
SGLang (`--sampling-defaults model`) and vLLM (`--generation-config auto`) make the defaults of
OpenAI requests that leave them out. Read once when the model loads; plain data."""

from __future__ import annotations

import json
from pathlib import Path

# SGLang's list (ModelConfig.get_default_sampling_params); vLLM's adds max_new_tokens
GENERATION_DEFAULT_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")
SAMPLING_DEFAULTS = ("model", "openai")  # EngineConfig.sampling_defaults: where defaults come from


def read_generation_defaults(model_dir: Path) -> dict[str, float | int]:
    """{name: value} of the keys above that the folder's generation_config.json gives a number
    (top_k an int); {} without the file."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    stated = json.loads(path.read_text())
    defaults: dict[str, float | int] = {}
    for key in GENERATION_DEFAULT_KEYS:
        value = stated.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if key == "top_k" and not isinstance(value, int):
            continue
        defaults[key] = value
    return defaults
