"""Neox rotary embedding of q and k in one launch, read straight from the qkv projection.

    qkv [tokens, (heads + 2 * kv_heads) * head_dim]    q heads | k heads | v heads, per token
    cos, sin [max_positions, >= head_dim / 2] float32  cos/sin of position * inv_freq (neox: the
                                                       second half of a head repeats the first)
    q_out[t, h] = (x1 cos - x2 sin | x2 cos + x1 sin)  for x = q[t, h] = (x1 | x2), the same for k

q goes to a new contiguous [tokens, heads * head_dim]. k goes either to a new [tokens, kv_heads *
head_dim], or, given the layer's KV buffers and the tokens' slots, straight to
`k_buffer[slots[t]]`, with v copied to `v_buffer[slots[t]]` (the attention backend then skips
its own store). One program per token covers all its heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(SRC, DST, dst_head_stride, cos, sin, offs, mask_d, num_heads,
                  HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    mask = (heads < num_heads)[:, None] & mask_d[None, :]
    src = SRC + heads[:, None] * HEAD_DIM + offs[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = DST + heads[:, None] * dst_head_stride + offs[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(DST.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(DST.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_qkv_kernel(
    QKV, POS, COS, SIN, Q_OUT, K_OUT, V_OUT, SLOTS,
    stride_qkv, stride_cos, stride_sin, stride_q_out,
    stride_k_row, stride_k_head, stride_v_row, stride_v_head,
    num_heads, num_kv_heads,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, STORE_KV: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + token).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    mask_d = offs < HALF
    cos = tl.load(COS + pos * stride_cos + offs, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(SIN + pos * stride_sin + offs, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    row = QKV + token * stride_qkv
    _rotate_heads(row, Q_OUT + token * stride_q_out, HEAD_DIM, cos, sin, offs, mask_d,
                  num_heads, HEAD_DIM, HALF, BLOCK_H)
    k_src = row + num_heads * HEAD_DIM
    if STORE_KV:
        slot = tl.load(SLOTS + token).to(tl.int64)
        _rotate_heads(k_src, K_OUT + slot * stride_k_row, stride_k_head, cos, sin, offs, mask_d,
                      num_kv_heads, HEAD_DIM, HALF, BLOCK_KV)
        heads = tl.arange(0, BLOCK_KV)
        mask = (heads < num_kv_heads)[:, None] & mask_d[None, :]
        v_src = k_src + num_kv_heads * HEAD_DIM + heads[:, None] * HEAD_DIM + offs[None, :]
        v_dst = V_OUT + slot * stride_v_row + heads[:, None] * stride_v_head + offs[None, :]
        tl.store(v_dst, tl.load(v_src, mask=mask, other=0.0).to(V_OUT.dtype.element_ty),
                 mask=mask)
        tl.store(v_dst + HALF,
                 tl.load(v_src + HALF, mask=mask, other=0.0).to(V_OUT.dtype.element_ty),
                 mask=mask)
    else:
        _rotate_heads(k_src, K_OUT + token * stride_k_row, stride_k_head, cos, sin, offs,
                      mask_d, num_kv_heads, HEAD_DIM, HALF, BLOCK_KV)


def rotary_qkv(positions: torch.Tensor, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               *, num_heads: int, num_kv_heads: int, head_dim: int,
               kv_buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
               slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(q [tokens, heads * head_dim], k [tokens, kv_heads * head_dim]) rotated, in qkv's dtype.

    With `kv_buffers` = (k_buffer, v_buffer) [slots, kv_heads, head_dim] and `slots` [tokens],
    the rotated k and the v of token t go to row slots[t] of those buffers (in their dtype)
    instead, and the returned k is None."""
    tokens = qkv.shape[0]
    assert head_dim % 2 == 0, "neox rotary needs an even head_dim"
    assert qkv.dim() == 2 and qkv.stride(-1) == 1
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
    assert cos.stride(-1) == 1 and sin.stride(-1) == 1 and cos.shape[-1] >= head_dim // 2
    q = torch.empty((tokens, num_heads * head_dim), dtype=qkv.dtype, device=qkv.device)
    if kv_buffers is None:
        k = torch.empty((tokens, num_kv_heads * head_dim), dtype=qkv.dtype, device=qkv.device)
        k_out = v_out = k.view(tokens, num_kv_heads, head_dim)  # v_out unused
        slots = positions  # unused
    else:
        assert slots is not None and slots.shape[0] == tokens
        k, (k_out, v_out) = None, kv_buffers
        assert k_out.stride(-1) == 1 and v_out.stride(-1) == 1
        assert k_out.shape[1:] == (num_kv_heads, head_dim) == v_out.shape[1:]
    if tokens:
        block_h = triton.next_power_of_2(num_heads)
        _rotary_qkv_kernel[(tokens,)](
            qkv, positions, cos, sin, q, k_out, v_out, slots,
            qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0),
            k_out.stride(0), k_out.stride(1), v_out.stride(0), v_out.stride(1),
            num_heads, num_kv_heads,
            HEAD_DIM=head_dim, HALF=head_dim // 2, BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
            BLOCK_H=block_h, BLOCK_KV=triton.next_power_of_2(num_kv_heads),
            STORE_KV=kv_buffers is not None,
            num_warps=4 if block_h * head_dim <= 2048 else 8,
        )
    return q, k
