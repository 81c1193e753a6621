"""Four e4m3 values packed in an int32 word (little-endian, as an FP8 tensor's bytes lie), converted
in registers: the FP8 GEMV reads its weights, and attention an FP8 pool's V rows, as int32 words.

Compiled for NVIDIA (`ASM`), two `cvt.rn.f16x2.e4m3x2` straight from the word's halves: Triton's
own cast of an FP8 tensor extracts each byte and repacks pairs first (twice the instructions),
and where the converted tile then changes layout for a dot, it moves the bytes (one shared-memory
read a byte) and converts after. Under the interpreter, shifts and Triton's cast."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e4m3x4(w, DTYPE: tl.constexpr, ASM: tl.constexpr):
    """int32 tensor of four e4m3 each -> four tensors of w's shape in DTYPE (float16 or float32),
    exact: byte i of each word in the i-th."""
    if ASM and DTYPE == tl.float16:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b16 lo, hi;
            .reg .b32 p01, p23;
            mov.b32 {lo, hi}, $4;
            cvt.rn.f16x2.e4m3x2 p01, lo;
            cvt.rn.f16x2.e4m3x2 p23, hi;
            mov.b32 {$0, $1}, p01;
            mov.b32 {$2, $3}, p23;
            }""",
            constraints="=h,=h,=h,=h,r", args=[w],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1)
    elif ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b16 lo, hi, h0, h1, h2, h3;
            .reg .b32 p01, p23;
            mov.b32 {lo, hi}, $4;
            cvt.rn.f16x2.e4m3x2 p01, lo;
            cvt.rn.f16x2.e4m3x2 p23, hi;
            mov.b32 {h0, h1}, p01;
            mov.b32 {h2, h3}, p23;
            cvt.f32.f16 $0, h0;
            cvt.f32.f16 $1, h1;
            cvt.f32.f16 $2, h2;
            cvt.f32.f16 $3, h3;
            }""",
            constraints="=f,=f,=f,=f,r", args=[w],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        w0 = (w & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(DTYPE)
        w1 = ((w >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(DTYPE)
        w2 = ((w >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(DTYPE)
        w3 = ((w >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(DTYPE)
        return w0, w1, w2, w3
