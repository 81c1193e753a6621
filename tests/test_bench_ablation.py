"""The engine-ablation and offline-profile benchmarks: kernel categories, busy time, the ablation
rows and table, and both scripts end to end on a tiny model on the CPU (the GPU-only switches are
asked for and reported as what ran)."""

from __future__ import annotations

import json

import pytest

from bench.common import format_markdown_table, format_table
from bench.engine_ablation import ablation_rows, table_rows
from bench.engine_ablation import main as ablation_main
from bench.json_decode import DUMMY_MAX_NEW_TOKENS, MAX_NEW_TOKENS
from bench.json_decode import parse_args as json_args
from bench.kernel_profile import KernelEvent, busy_us, kernel_category, summarize
from bench.profile_offline import main as profile_main
from bench.profile_offline import parse_windows


@pytest.mark.parametrize(("name", "category"), [
    ("sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NTN", "gemm"),
    ("void gemv2T_kernel_val<int, int, __half, __half, float, 128, 16>", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_f16_s16816gemm_relu_f16_64x64_64x4_nn>", "gemm"),
    ("_decode_partial_kernel", "attention_decode"),
    ("void flashinfer::BatchDecodeWithPagedKVCacheKernel<...>", "attention_decode"),
    ("_extend_kernel", "attention_prefill"),
    ("void flashinfer::BatchPrefillWithPagedKVCacheKernel<...>", "attention_prefill"),
    ("_rms_norm_kernel", "norm_rope_act"),
    ("_rotary_qkv_kernel", "norm_rope_act"),
    ("_silu_and_mul_kernel", "norm_rope_act"),
    ("void (anonymous namespace)::softmax_warp_forward<float, float, float, 10, false>",
     "sampling_logits"),
    ("void at::native::reduce_kernel<512, 1, ReduceOp<float, ArgMaxOps<float>, ...>>",
     "sampling_logits"),
    ("void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<...>", "sampling_logits"),
    ("void at::native::vectorized_elementwise_kernel<4, direct_copy_kernel_cuda...>",
     "copy_memset"),
    ("Memcpy HtoD (Pinned -> Device)", "copy_memset"),
    ("Memset (Device)", "copy_memset"),
    ("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<c10::Half>, ...>",
     "elementwise"),
    ("aten::addmm", "gemm"),
    ("some_new_kernel", "other"),
])
def test_kernel_names_fall_into_their_category(name, category):
    assert kernel_category(name) == category


def test_busy_time_counts_overlapping_kernels_once():
    events = [KernelEvent("a", 0, 10), KernelEvent("b", 5, 12), KernelEvent("c", 20, 25),
              KernelEvent("d", 21, 22)]
    assert busy_us(events) == 17
    summary = summarize(events, wall_seconds=50e-6, passes=2)
    assert summary["busy_seconds"] == pytest.approx(17e-6)
    assert summary["kernel_seconds"] == pytest.approx(23e-6)
    assert summary["idle_ms_per_pass"] == pytest.approx(1e3 * 33e-6 / 2)
    assert summary["categories"]["other"]["count"] == 4
    assert summary["top_kernels"][0]["name"] == "a"


def test_windows_parse_in_order_only():
    assert parse_windows("10:30, 150:40") == [(10, 30), (150, 40)]
    for bad in ("10", "10:0", "a:3", "10:30,20:5"):
        with pytest.raises(ValueError):
            parse_windows(bad)


def test_markdown_table_escapes_pipes_and_right_aligns_numbers():
    text = format_markdown_table(["engine", "ms"], [["a|b", 1.5], ["c", None]])
    assert text.splitlines() == ["| engine | ms |", "| --- | ---: |", "| a\\|b | 1.50 |",
                                 "| c | - |"]
    assert format_table(["engine", "ms"], [])  # no rows: just the header


def test_ablation_rows_cross_every_switch():
    rows = ablation_rows(["flashinfer", "triton"], [True, False], [True, False])
    assert len(rows) == 8
    assert rows[0].label == "FlashInfer, graphs on, overlap on"
    assert rows[-1].runtime_options() == {"attention_backend": "triton",
                                          "disable_cuda_graph": True,
                                          "disable_overlap_schedule": True}


def test_json_decode_gives_random_weights_room_to_finish():
    assert json_args([]).max_new_tokens == MAX_NEW_TOKENS
    assert json_args(["--dummy-config", "llama-2-7b"]).max_new_tokens == DUMMY_MAX_NEW_TOKENS
    with pytest.raises(SystemExit):
        json_args(["--tokenizer", "x"])


def test_engine_ablation_runs_one_runtime_per_row_and_writes_its_table(tiny_models, tmp_path):
    output = tmp_path / "ablation.json"
    ablation_main(["--model", str(tiny_models["llama-gqa"]), "--device", "cpu",
                   "--backends", "torch_native", "--graphs", "on", "--overlap", "on,off",
                   "--prompt-len", "8", "--batch-size", "2", "--decode-steps", "2",
                   "--repeats", "1", "--offline-seqs", "2", "--offline-min-len", "4",
                   "--offline-max-len", "8", "--output", str(output)])
    payload = json.loads(output.read_text())
    runs = payload["runs"]
    assert [r["overlap_schedule"] for r in runs] == [True, False]
    assert all(not r["cuda_graphs"] and "error" not in r for r in runs)  # no graphs on a CPU
    assert all(r["batch_n"]["batch_size"] == 2 and r["offline"]["seqs"] == 2 for r in runs)
    assert payload["table"]["rows"] == [list(row) for row in table_rows(runs)]
    assert payload["table"]["rows"][0][0] == "torch, graphs on, overlap on (got graphs off)"


def test_profile_offline_profiles_its_windows(tiny_models, tmp_path):
    output = tmp_path / "profile.json"
    profile_main(["--model", str(tiny_models["llama-gqa"]), "--device", "cpu",
                  "--num-seqs", "2", "--max-input-len", "16", "--max-output-len", "8",
                  "--windows", "1:2,50:5", "--output", str(output)])
    payload = json.loads(output.read_text())
    (window,) = payload["windows"]
    assert window["window"] == [1, 2] and window["passes"] == 2
    assert window["schedule"]["decode_passes"] == 2
    assert window["kernel_seconds"] > 0
    assert payload["windows_not_profiled"] == [[50, 5]]
