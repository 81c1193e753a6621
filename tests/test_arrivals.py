"""The arrival counters' buffer (`kernels/arrivals.py`): zero, one per device, grown outside a
CUDA-graph capture with the outgrown buffer kept (tests/gpu/test_fp8_cuda.py: inside one)."""

from __future__ import annotations

import torch

from lmnb.runtime.kernels import arrivals


def test_counters_are_one_zero_buffer_that_grows_and_keeps_what_it_outgrew():
    device = torch.device("cpu")
    small = arrivals.arrival_counters(device, 4)
    assert small.dtype == torch.int32 and not small.any()
    again = arrivals.arrival_counters(device, 16)
    assert again.data_ptr() == small.data_ptr()  # one buffer
    need = small.untyped_storage().nbytes() // 4 + 1
    grown = arrivals.arrival_counters(device, need)
    assert grown.numel() == need and not grown.any()
    assert grown.data_ptr() != small.data_ptr()
    # a captured graph may still count in the old buffer: it stays allocated
    assert any(t.data_ptr() == small.data_ptr() for t in arrivals._OUTGROWN)
