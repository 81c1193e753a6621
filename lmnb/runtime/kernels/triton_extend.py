"""Extend (prefill) attention for a ragged batch over the token-level KV pool, in Triton.

Request i's new tokens are q rows qo_indptr[i] : qo_indptr[i + 1]; its whole KV (cached prefix
then the new tokens) is the slots kv_indices[kv_indptr[i] : kv_indptr[i + 1]]. The new tokens'
K/V are read from the pool, so the caller writes them there first (the backend does, with
`KVStorage.set_kv`): prefix and new tokens are read the same way, through kv_indices.

One program per (request, KV head, block of BLOCK_M rows), a row being one (new token, query head
of that KV head) pair, tokens major: the GQA group's query heads share each K/V tile they load
(read once per group instead of once per head, and short extends fill the tile). Online softmax
over blocks of BLOCK_N KV tokens: first the columns every row of the block sees (the prefix and
the new tokens before the block's first token; no causal mask), then the block's diagonal with
the mask col <= prefix_len + token; blocks past the row block's causal edge are never loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lmnb.runtime.kernels.attend import attend_block, fp8_pool_compute, fp8_pool_query
from lmnb.runtime.kernels.dot import dot_operand, dot_upcast


@triton.jit
def _extend_kernel(
    Q, K, V, K_SCALE, V_SCALE, OUT, QO_INDPTR, KV_INDPTR, KV_INDICES,
    scale, stride_st, stride_sh,
    stride_qt, stride_qh,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr = False, K_ROWS: tl.constexpr = False,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    block = tl.program_id(2)

    q_begin = tl.load(QO_INDPTR + req)
    extend_len = tl.load(QO_INDPTR + req + 1) - q_begin
    if block * BLOCK_M < extend_len * GROUP:
        kv_begin = tl.load(KV_INDPTR + req)
        seq_len = tl.load(KV_INDPTR + req + 1) - kv_begin
        prefix_len = seq_len - extend_len

        packed = block * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = packed // GROUP  # [BLOCK_M] new token of each row
        heads = kv_head * GROUP + packed % GROUP
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        mask_m = rows < extend_len
        mask_d = offs_d < HEAD_DIM
        # q/out rows in 64 bits: a pass's tokens x heads x head_dim may pass 2^31 where the pool's
        # offsets (int32 metadata, `kernel_index_dtype`) do not
        tokens = (q_begin + rows).to(tl.int64)
        q = tl.load(Q + tokens[:, None] * stride_qt + heads[:, None] * stride_qh
                    + offs_d[None, :], mask=mask_m[:, None] & mask_d[None, :], other=0.0)
        if KV_FP8:  # FP8 pool: K/V converted to the dtype of fp8_pool_query's q
            q, q_scale = fp8_pool_query(q)
        else:
            q = dot_operand(q.to(K.dtype.element_ty), UPCAST)
            q_scale = tl.full([BLOCK_M], 1.0, dtype=tl.float32)  # unread
        last = prefix_len + rows  # [BLOCK_M] the last KV position each row may see
        k_scales = K_SCALE + kv_head * stride_sh  # this KV head's (FP8 pools)
        v_scales = V_SCALE + kv_head * stride_sh

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        # Columns every row of this block sees (the cached prefix and the new tokens up to the
        # block's first token): only the length bound masks. Column prefix_len is among them,
        # so each row's running max is finite before the causal part.
        visible_end = prefix_len + (block * BLOCK_M) // GROUP + 1
        for n in range(0, visible_end, BLOCK_N):
            m_i, l_i, acc = attend_block(
                q, K, V, KV_INDICES + kv_begin, n, visible_end, last, m_i, l_i, acc, scale,
                kv_head, stride_kt, stride_kh, stride_vt, stride_vh, offs_n, offs_d, mask_d,
                False, PRECISION, UPCAST, KV_FP8, K_ROWS, k_scales, v_scales, stride_st,
                q_scale, HEAD_DIM)
        # The block's diagonal, causally; columns past its last row are never loaded (fully
        # masked columns of a row add exp(-inf) = 0).
        kv_end = tl.minimum(seq_len, prefix_len + ((block + 1) * BLOCK_M - 1) // GROUP + 1)
        for n in range(visible_end, kv_end, BLOCK_N):
            m_i, l_i, acc = attend_block(
                q, K, V, KV_INDICES + kv_begin, n, kv_end, last, m_i, l_i, acc, scale,
                kv_head, stride_kt, stride_kh, stride_vt, stride_vh, offs_n, offs_d, mask_d,
                True, PRECISION, UPCAST, KV_FP8, K_ROWS, k_scales, v_scales, stride_st,
                q_scale, HEAD_DIM)
        out = acc / l_i[:, None]
        tl.store(OUT + tokens[:, None] * stride_ot + heads[:, None] * stride_oh
                 + offs_d[None, :], out.to(OUT.dtype.element_ty),
                 mask=mask_m[:, None] & mask_d[None, :])


class ExtendConfig(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    k_rows: bool = False  # load K token-major and transpose it for the dot


def extend_config(head_dim: int, dtype: torch.dtype, *, rows: Sequence[int] = (),
                  group: int = 1) -> ExtendConfig:
    """Tile sizes by head size and element width (fp32 heads of 128+ need smaller KV tiles), by
    the GQA group and by the requests' rows (each one's new tokens x group). With GQA 128-row
    blocks over 8 warps, or 64-row blocks where 128 would pad the batch's rows by a fifth more
    (e.g. 160 rows a request: 256 instead of 192); MHA (group 1) always 64-row blocks. So a
    request's result may differ in its last bits with the batch it runs in, as the GEMMs'
    (cuBLAS picks its kernel by the batch's rows) already do."""
    wide = triton.next_power_of_2(head_dim) * torch.empty((), dtype=dtype).element_size() > 256
    if wide:
        return ExtendConfig(64, 32, 4, 2)
    # H100, triton 3.6, bf16 head_dim 128, Llama-3 GQA (bench/extend_kernel.py --sweep):
    # 128 x 32 tiles over 8 warps 256 / 345 us on the offline chunk / fork shapes (128 rows a
    # request) against 271 / 413 for 64-row blocks; at the shared-prefix shape (160 rows a
    # request) 64-row blocks with K token-major 1,193 us against 1,384.
    # H200, Llama-2 MHA offline chunk (13 requests, 8,192 new tokens, no prefix): 64 x 32 over
    # 4 warps with K token-major 331.8 us against 518.8 for 128 x 32 over 8 warps.
    # H200, the shared-prefix run's passes (int32 metadata): a long prompt's chunk beside 155
    # questions of 40 tokens after cached prefixes 1,023 us with 128-row blocks, 902 with 64.
    if group == 1:
        return ExtendConfig(64, 32, 4, 3, k_rows=True)
    padded = sum(triton.cdiv(n, 128) * 128 for n in rows)
    if padded <= 1.2 * sum(triton.cdiv(n, 64) * 64 for n in rows):
        return ExtendConfig(128, 32, 8, 3)
    return ExtendConfig(64, 32, 4, 3, k_rows=True)


def extend_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                     out: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                     kv_indices: torch.Tensor, *, max_extend_len: int, scale: float,
                     config: ExtendConfig | None = None,
                     kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Causal attention of each request's new tokens to its cached prefix and to themselves.

    q, out [num_tokens, heads, head_dim]; k_buffer, v_buffer [slots, kv_heads, head_dim] already
    holding the new tokens' K/V; `max_extend_len` >= the longest request's new-token count.
    An FP8 pool needs its `kv_scales` (k_scales, v_scales) [slots, kv_heads] float32 (any
    strides, the same for both).
    """
    bs = qo_indptr.numel() - 1
    _, num_heads, head_dim = q.shape
    group = num_heads // k_buffer.shape[1]
    block_d = triton.next_power_of_2(head_dim)
    config = config or extend_config(head_dim, k_buffer.dtype, rows=[max_extend_len * group],
                                     group=group)
    kv_fp8 = k_buffer.dtype == torch.float8_e4m3fn
    compute = fp8_pool_compute(q.dtype) if kv_fp8 else k_buffer.dtype  # what the dots multiply
    assert not kv_fp8 or kv_scales is not None, "an FP8 pool needs its scales"
    assert not kv_fp8 or (v_buffer.stride(-1) == 1 and v_buffer.stride(0) % 4 == 0
                          and v_buffer.stride(1) % 4 == 0), "FP8 V rows are read as int32 words"
    k_scale, v_scale = kv_scales if kv_fp8 else (kv_indptr, kv_indptr)  # unread without FP8
    assert not kv_fp8 or v_scale.stride() == k_scale.stride(), "K and V scales share strides"
    precision = "ieee" if compute == torch.float32 else "tf32"
    for t in (q, k_buffer, v_buffer, out):
        assert t.stride(-1) == 1, "the head dimension must be contiguous"
    grid = (bs, num_heads // group, triton.cdiv(max(max_extend_len, 1) * group, config.block_m))
    _extend_kernel[grid](
        q, k_buffer, v_buffer, k_scale, v_scale, out, qo_indptr, kv_indptr, kv_indices,
        scale, *(k_scale.stride() if kv_fp8 else (0, 0)),
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, PRECISION=precision, UPCAST=dot_upcast(compute), KV_FP8=kv_fp8,
        K_ROWS=config.k_rows, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
