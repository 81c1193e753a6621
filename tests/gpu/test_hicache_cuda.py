"""The hierarchical cache on CUDA (pinned host pool, copies on a side stream): greedy fp32
outputs are the same whether a prefix is computed, hit on the device, loaded back from host
memory or loaded from disk pages by a new Runtime."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.test_hicache_runtime import OPTIONS, check_tiers, computed

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_tiers_on_cuda_give_the_computed_tokens(tiny_models, tmp_path: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    options = dict(OPTIONS, device="cuda")
    model = tiny_models["llama-gqa"]
    check_tiers(model, options, computed(model, options), tmp_path)
