"""Our LLaVA models against HF transformers (fp32, CPU) on tiny random-weight llava-hf folders."""

from __future__ import annotations

import json

from tests.llava_fixtures import LLAVA_VARIANTS


def test_fixture_folders_are_llava_hf_style(tiny_llavas):
    from transformers import AutoImageProcessor, AutoTokenizer

    assert sorted(tiny_llavas) == sorted(LLAVA_VARIANTS)
    for folder in tiny_llavas.values():
        assert AutoImageProcessor.from_pretrained(folder) is not None
        tokenizer = AutoTokenizer.from_pretrained(folder)
        assert tokenizer.convert_tokens_to_ids(["<image>", "<video>"]) == [49152, 49153]
        config = json.loads((folder / "config.json").read_text())
        assert config["text_config"]["vocab_size"] == 49154
