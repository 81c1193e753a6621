"""The token view of the CPU test's program (tests/test_token_view.py) run on a CUDA device: its
colours count the requests' meta_info (origins and top-5 logprobs from the CUDA sampler's packed
logprob kernel), and its metrics bar shows the GPU memory in use."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("anywidget")

from lmnb.lang.backends.local import LocalBackend  # noqa: E402
from lmnb.runtime.engine import Runtime  # noqa: E402
from lmnb.runtime.output.token_origins import count_origin  # noqa: E402
from lmnb.widgets.metrics import metrics_html, program_metrics, runtime_stats  # noqa: E402
from tests.test_token_view import PREFIX, WHY_TOKENS, _metas, answer_and_explain  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_token_view_on_cuda(tiny_models) -> None:
    with Runtime(tiny_models["llama-gqa"], device="cuda", dtype="float32",
                 max_total_tokens=4096) as runtime:
        backend = LocalBackend(runtime)
        runtime.cache_prefix(PREFIX)
        state = answer_and_explain.run(backend=backend, token_view=True, stream=True)
        view = state.token_view()
        state.run.settle()
        view.refresh()
        assert view.done and [row["label"] for row in view.rows] == ["root", "fork 1", "fork 2"]
        spans = [m["output_token_origins"] for m in _metas(state)]
        answer = state.get_meta_info("answer")
        assert view.counts["cached"] == answer["cached_tokens"] > 0
        assert view.counts["jump_forward"] == sum(count_origin(s, "jump_forward")
                                                  for s in spans) > 0
        assert view.counts["generated"] == sum(count_origin(s, "generated") for s in spans)
        for fork in view.rows[1:]:
            tokens = view.tokens(fork)
            assert len(tokens) == WHY_TOKENS
            for _, _, logprob, alternatives in tokens:  # from the kernel: best first
                assert logprob <= 0 and len(alternatives) == 5
                values = [lp for _, lp in alternatives]
                assert values == sorted(values, reverse=True) and logprob <= values[0] + 1e-3
                assert sum(math.exp(lp) for lp in values) <= 1 + 1e-3
        metrics = program_metrics(state, runtime_stats(state))
        assert metrics is not None and metrics.gpu_allocated_gb > 0
        assert metrics.gpu_total_gb > metrics.gpu_allocated_gb
        assert 'data-metric="gpu_memory"' in metrics_html(metrics)
        assert 'data-metric="gpu_memory"' in view._repr_mimebundle_()[0]["text/html"]
        view.close()
