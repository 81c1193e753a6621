"""Random weights of real architectures for the benchmarks (`--dummy-config NAME`): the shapes of
each architecture, and a model folder holding only its config.json, loaded with
`load_format="dummy"` and some other model's tokenizer (random-weight text is meaningless; the
tokenizer only encodes prompts and detokenizes)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_LLAMA_2_7B = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=4096,
    intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
    vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
    hidden_act="silu", tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    initializer_range=0.02, dtype="float16")

# Real architectures' shapes for random-weight runs (--dummy-config NAME).
DUMMY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-2-7b": _LLAMA_2_7B,
    "llama-2-13b": {**_LLAMA_2_7B, "hidden_size": 5120, "intermediate_size": 13824,
                    "num_hidden_layers": 40, "num_attention_heads": 40,
                    "num_key_value_heads": 40},
    "llama-3-8b": {**_LLAMA_2_7B, "intermediate_size": 14336, "num_key_value_heads": 8,
                   "vocab_size": 128256, "max_position_embeddings": 8192,
                   "rope_theta": 500000.0, "bos_token_id": 128000, "eos_token_id": 128001,
                   "dtype": "bfloat16"},
    "mistral-7b": {**_LLAMA_2_7B, "model_type": "mistral",
                   "architectures": ["MistralForCausalLM"], "intermediate_size": 14336,
                   "num_key_value_heads": 8, "max_position_embeddings": 32768,
                   "sliding_window": None, "dtype": "bfloat16"},
    "qwen2-7b": {**_LLAMA_2_7B, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                 "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                 "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                 "max_position_embeddings": 32768, "rope_theta": 1000000.0,
                 "rms_norm_eps": 1e-6, "bos_token_id": 151643, "eos_token_id": 151643,
                 "dtype": "bfloat16"},
    "smollm2-135m": {**_LLAMA_2_7B, "hidden_size": 576, "intermediate_size": 1536,
                     "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                     "vocab_size": 49152, "max_position_embeddings": 8192,
                     "rope_theta": 100000.0, "tie_word_embeddings": True,
                     "dtype": "bfloat16"},
    # Llama-3 shrunk to a CPU-sized check (bench/vs_vllm.py --tiny): its vocabulary, so that the
    # real Llama-3 tokenizer's ids are all rows of the embedding, and a head size (64) that GPU
    # attention kernels take, for a quick smoke run there too.
    "tiny-llama-3": {**_LLAMA_2_7B, "hidden_size": 256, "intermediate_size": 512,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "vocab_size": 128256, "max_position_embeddings": 8192,
                     "rope_theta": 500000.0, "tie_word_embeddings": True,
                     "bos_token_id": 128000, "eos_token_id": 128001, "dtype": "float32"},
}


@dataclass(frozen=True)
class DummyModel:
    """A folder with only the config.json of a `DUMMY_CONFIGS` architecture, and its tokenizer."""

    name: str
    path: Path
    tokenizer_path: Path
    fields: dict[str, Any]

    @property
    def dtype(self) -> str:
        return self.fields["dtype"]

    @property
    def label(self) -> str:
        return f"dummy {self.name} (random weights)"

    def runtime_options(self) -> dict[str, Any]:
        """The `Runtime` options that load this folder's random weights with the tokenizer."""
        return {"tokenizer_path": str(self.tokenizer_path), "load_format": "dummy",
                "dtype": self.dtype}


def write_dummy_model(name: str, root: str | Path, tokenizer: str | Path | None = None, *,
                      grow_vocab: bool = True) -> DummyModel:
    """Writes `root/name/config.json`. `tokenizer` is a folder (None: the embedded SmolLM2's);
    with `grow_vocab` the vocabulary grows to the tokenizer's when that is larger, so that every
    id the tokenizer can produce (prompts, constrained decoding) is a row of the embedding."""
    from lmnb.runtime.models import loader

    tokenizer_dir = loader.resolve_tokenizer_dir(tokenizer)
    fields = dict(DUMMY_CONFIGS[name])
    if grow_vocab:
        fields["vocab_size"] = max(fields["vocab_size"],
                                   len(loader.load_tokenizer(tokenizer_dir)))
    folder = Path(root) / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(fields))
    return DummyModel(name=name, path=folder, tokenizer_path=Path(tokenizer_dir), fields=fields)


def write_self_contained_dummy_model(name: str, root: str | Path,
                                     tokenizer: str | Path) -> DummyModel:
    """Writes `root/name/` with the architecture's config.json (its own vocabulary) and copies of
    the files of the HF tokenizer folder `tokenizer` (a folder with no config.json will do): a
    folder that serves itself, for engines that take one folder for both (vLLM's
    `LLM(model=d, tokenizer=d)`), so that every engine reads the same files."""
    import shutil

    from lmnb.runtime.models.loader import TOKENIZER_FILES

    source = Path(tokenizer)
    files = [file for file in TOKENIZER_FILES if (source / file).is_file()]
    if not files:
        raise FileNotFoundError(f"no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {source}")
    fields = dict(DUMMY_CONFIGS[name])
    folder = Path(root) / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(fields))
    for file in files:
        shutil.copyfile(source / file, folder / file)
    return DummyModel(name=name, path=folder, tokenizer_path=folder, fields=fields)
