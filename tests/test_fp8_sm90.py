"""The FP8 Triton kernels compiled for an H100 (sm_90) on a machine without one (tests/sm90.py):
the skinny GEMM over FP8 weights in each of decode's fused forms, its split-K reduce, decode
over an FP8 pool, the per-token activation quantizer (alone, and fused into RMSNorm and
SiLU-and-mul), the rotary kernel's FP8 K/V store, the weight-only GEMM and the W8A8 GEMM; the
PTX checks what the interpreter cannot (register layouts, instructions, the FP8 K/V store's
gpu-scope arrival counter). tests/test_fp8.py runs the same kernels in the interpreter;
tests/gpu/test_fp8_cuda.py on a GPU."""

from __future__ import annotations

import pytest

from tests.sm90 import assert_compiles_for_sm90
from tests.triton_modes import INTERPRET

_COMPILE_FOR_HOPPER = """
from lmnb.runtime.kernels import triton_decode
from lmnb.runtime.kernels.fused import (activation, fp8_quant, gemv, gemv_fp8, mm_fp8,
                                        rmsnorm, rope)

f8, dt, i64 = "*fp8e4nv", "*bf16", "*i64"
gemv_args = {"W_SCALE": "*fp32", "B": dt, "OUT": dt, "PARTIAL": "*fp32",
             **{n: "i32" for n in ("M", "N", "K", "stride_xm", "stride_wn", "stride_om",
                                   "k_span", "hidden", "stride_x16", "stride_cos", "stride_k_row",
                                   "stride_k_head", "stride_v_row", "stride_v_head",
                                   "num_heads", "num_kv_heads")}, "eps": "fp32",
             "POS": i64, "COS": "*fp32", "SIN": "*fp32", "SLOTS": i64, "K_OUT": f8, "V_OUT": f8,
             "K_SCALE": "*fp32", "V_SCALE": "*fp32", "STAGE": "*fp32", "ARRIVALS": "*i32",
             "stride_st": "i32", "stride_sh": "i32"}
# aligned as the launcher's arguments are at Llama shapes; gated: gate_up with SiLU-and-mul;
# norm: RMSNorm + the residual add in the prologue (qkv, and gate_up with gated); rotary: qkv's
# rotary in the epilogue, k and v stored to an FP8 pool with their scales
for use_dot, gated, norm, rotary, fixed in (
        (False, False, False, False, False), (True, False, False, False, False),
        (False, True, False, False, False), (False, False, True, False, False),
        (False, True, True, False, False), (True, True, True, False, False),
        (False, False, True, True, False), (True, False, True, True, False),
        (False, False, True, True, True), (True, False, True, True, True)):
    packed = not use_dot  # FMA path: 4 weights an int32, 4 bf16 activations an int64
    prefetch = not use_dot and not gated  # as the tuned configs: qkv and down 2 stages, gate_up 1
    vec = "*i64" if packed else dt
    args = {"X": vec, "W": "*i32" if packed else f8, "RES": vec, "NORM_W": vec, "X16": dt,
            "RES16": dt, "RES_OUT": dt, **gemv_args}
    kernel = compile(gemv_fp8._fp8_gemv_kernel, args,
                     {"HAS_BIAS": False, "SPLIT_K": 1, "EVEN_K": True,
                      "BLOCK_M": 16 if use_dot else 1, "BLOCK_N": 64 if use_dot else 2,
                      "BLOCK_K": 256 if use_dot else 1024 // 4,
                      "VEC_K": gemv_fp8.DOT_VEC if use_dot else gemv_fp8.FMA_VEC // 4,
                      "USE_DOT": use_dot, "DOT_UPCAST": False, "PREFETCH": prefetch,
                      "PACKED": packed, "X_BF16": True, "ASM_CVT": True, "GATED": gated,
                      "NORM": norm, "HAS_RES": norm, "ROPE": rotary, "HEAD_DIM": 128, "HALF": 64,
                      "KV_FP8": rotary and not fixed, "BLOCK_HALF": 64,
                      "HEADS_A_PROGRAM": 2 if use_dot else 1, "KV_FIXED_FP8": fixed,
                      "USE_PDL": True},
                     aligned=[name for name in args if name not in ("M", "eps")])
    loop = kernel.asm["ttgir"].split("scf.for")[1].split("scf.yield")[0]
    if not use_dot:  # weight and x loads share one register layout: no shuffle in the loop
        assert "convert_layout" not in loop and "local_alloc" not in loop, loop
        ptx = kernel.asm["ptx"]
        assert "ld.global.L1::evict_first.L2::cache_hint.v2.b32" in ptx
        # 2 rows x 8 weights a step, a pair each; without prefetch the first step is apart
        assert ptx.count("cvt.rn.f16x2.e4m3x2") == (8 if prefetch else 16)
        if prefetch:  # the loop's weight loads are the next step's: ahead of its conversions
            assert ptx.rindex("ld.global.L1::evict_first") < ptx.index("cvt.rn.f16x2.e4m3x2")
        # the first weight tile is read before the wait for the kernel in front (PDL)
        wait = ptx.index("griddepcontrol.wait")
        assert ptx.index("ld.global.L1::evict_first") < wait
        assert "ld.global" not in ptx[:wait].replace("ld.global.L1::evict_first", "")
        assert ("ex2.approx" in ptx) == gated  # silu's exp in the epilogue
        assert ("rsqrt" in ptx) == norm  # the norm's x + r and s * g: bf16x2 instructions
        assert ("add.rn.bf16x2" in ptx) == ("mul.rn.bf16x2" in ptx) == norm
    if rotary:  # the FP8 store: a head's pairs counted in at gpu scope, its rows read from L2;
        # with fixed scales neither: each pair stored as it is rotated
        ptx = kernel.asm["ptx"]
        assert ("atom.global.gpu.acq_rel.add" in ptx) == ("ld.global.cg" in ptx) == (not fixed)
compile(gemv._split_k_reduce_kernel,
        {"PARTIAL": "*fp32", "B": dt, "OUT": dt, "M": "i32", "N": "i32", "stride_om": "i32"},
        {"HAS_BIAS": True, "SPLIT_K": 4, "BLOCK": 1024, "GATED": True})
# decode over an FP8 pool: a small tile and a large one (head-major scales: stride 1)
for block_n, warps in ((64, 4), (256, 8)):
    kernel = compile(triton_decode._decode_partial_kernel,
            triton_decode.partial_kernel_types(q=dt, kv=f8, index=i64),
            {"GROUP": 4, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_H": 16, "BLOCK_N": block_n,
             "MAX_SPLITS": 2, "MIN_SPLIT": 1024, "PRECISION": "tf32", "UPCAST": False,
             "HAS_SKIP": False, "KV_FP8": True, "PREFETCH": True, "K_ROWS": True,
             "HEADS_FIRST": False},
            warps=warps)
    assert kernel.metadata.shared <= 227 * 1024, kernel.metadata.shared
    # bf16 q's dots over the pool multiply float16: e4m3 pairs convert in one instruction
    ptx = kernel.asm["ptx"]
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx
    assert "cvt.rn.f16x2.e4m3x2" in ptx and "cvt.bf16.f16" not in ptx
    # V converted where it was loaded, then transposed for the dot as 16-bit (not byte) reads
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx and "ld.shared.b8" not in ptx
compile(fp8_quant._per_token_quant_kernel,
        {"X": dt, "OUT": f8, "SCALE": "*fp32", "K": "i32", "stride_x": "i32",
         "stride_out": "i32"}, {"BLOCK": 2048, "FP8_MAX_C": 448.0, "MIN_SCALE_C": 1e-12},
        warps=8)
# the quantizer fused into RMSNorm (+ the residual add) and SiLU-and-mul (one block a row, and
# the two-pass loop)
compile(rmsnorm._rms_norm_quant_kernel,
        {"X": dt, "RES": dt, "W": dt, "OUT": f8, "SCALE": "*fp32", "RES_OUT": dt,
         **{n: "i32" for n in ("stride_x", "stride_res", "stride_out", "stride_res_out",
                               "hidden")}, "eps": "fp32"},
        {"HAS_RESIDUAL": True, "BLOCK": 4096, "FP8_MAX_C": 448.0, "MIN_SCALE_C": 1e-12},
        warps=8)
for block, one_block, warps in ((16384, True, 16), (4096, False, 8)):
    compile(activation._silu_and_mul_quant_kernel,
            {"X": dt, "OUT": f8, "SCALE": "*fp32", "stride_x": "i32", "stride_out": "i32",
             "width": "i32"},
            {"BLOCK": block, "ONE_BLOCK": one_block, "FP8_MAX_C": 448.0, "MIN_SCALE_C": 1e-12},
            warps=warps)
for fixed in (False, True):
    compile(rope._rotary_qkv_kernel,
            {"QKV": dt, "Q_OUT": dt, "K_OUT": f8, "V_OUT": f8, "K_SCALE": "*fp32",
             "V_SCALE": "*fp32", "POS": i64, "SLOTS": i64, "COS": "*fp32", "SIN": "*fp32",
             **{n: "i32" for n in ("stride_qkv", "stride_cos", "stride_sin", "stride_q_out",
                                   "stride_k_row", "stride_k_head", "stride_v_row",
                                   "stride_v_head", "stride_st", "stride_sh", "num_heads",
                                   "num_kv_heads")}},
            {"HEAD_DIM": 128, "HALF": 64, "BLOCK_HALF": 64, "BLOCK_H": 32, "BLOCK_KV": 8,
             "STORE_KV": True, "KV_FP8": True, "FIXED_SCALES": fixed, "FP8_MAX": 448.0})
for bm, warps in ((64, 4), (128, 8)):  # the weight-only GEMM: FP8 tiles -> bf16 -> wgmma
    kernel = compile(mm_fp8._w8a16_mm_kernel,
                     {"X": dt, "W": f8, "SCALE": "*fp32", "B": dt, "OUT": dt,
                      "PARTIAL": "*fp32", **{n: "i32" for n in ("M", "N", "K", "K_SPAN",
                                                                "stride_xm", "stride_wn",
                                                                "stride_om")}},
                     {"HAS_BIAS": False, "BLOCK_M": bm, "BLOCK_N": 128, "BLOCK_K": 64,
                      "GROUP_M": 8, "PRECISION": "tf32", "UPCAST": False,
                      "SPLIT_K": 1}, warps=warps,
                     aligned=["X", "W", "SCALE", "OUT", "PARTIAL", "K", "K_SPAN", "stride_xm",
                              "stride_wn", "stride_om"])
    assert "cvt.rn.f16x2.e4m3x2" in kernel.asm["ptx"] and "wgmma" in kernel.asm["ptx"]
for bm, bn, split, swap in ((64, 64, 1, False), (64, 128, 1, False), (16, 64, 4, False),
                            (16, 64, 4, True)):
    # W8A8: 64-row tiles take FP8 rows and FP8 weight tiles straight into FP8 wgmma; decode's
    # 16-row tiles (K split) are too few rows for wgmma, and Triton converts them to f16 for
    # mma.sync in registers, unless swapped: the weight's 64 rows on wgmma's M side, x's 16 on N
    kernel = compile(mm_fp8._w8a8_mm_kernel,
                     {"X": f8, "X_SCALE": "*fp32", "W": f8, "W_SCALE": "*fp32", "B": dt,
                      "OUT": dt, "PARTIAL": "*fp32",
                      **{n: "i32" for n in ("M", "N", "K", "K_SPAN", "stride_xm", "stride_wn",
                                            "stride_om")}},
                     {"HAS_BIAS": False, "EVEN_K": True, "BLOCK_M": bm, "BLOCK_N": bn,
                      "BLOCK_K": 128, "GROUP_M": 8, "SPLIT_K": split, "SWAP_AB": swap},
                     warps=4, aligned=["X", "W", "X_SCALE", "W_SCALE", "OUT", "PARTIAL", "K",
                                       "K_SPAN", "stride_xm", "stride_wn", "stride_om"])
    ptx = kernel.asm["ptx"]
    if bm == 64 or swap:
        mma = f"m64n{bm}k32" if swap else f"m64n{bn}k32"
        assert f"wgmma.mma_async.sync.aligned.{mma}.f32.e4m3.e4m3" in ptx, (bn, swap)
        assert "cvt.rn.f16x2.e4m3x2" not in ptx
    else:
        assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx
    assert kernel.metadata.shared <= 227 * 1024
print("compiled")
"""


@pytest.mark.skipif(not INTERPRET, reason="on a GPU tests/gpu/test_fp8_cuda.py compiles them")
def test_fp8_kernels_compile_for_a_hopper_gpu():
    """The FP8 variants (skinny GEMM over FP8 weights, also with gate_up's SiLU-and-mul, the
    RMSNorm and qkv's rotary fused, and its split-K reduce, decode over an FP8 pool — extend
    shares its `attend_block` —, the rotary kernel storing FP8 K/V) compile for sm_90, in a
    process without TRITON_INTERPRET; the FP8 GEMM's FMA loop moves no weight through shared
    memory (8-byte weight loads in the activations' layout)."""
    assert_compiles_for_sm90(_COMPILE_FOR_HOPPER)
