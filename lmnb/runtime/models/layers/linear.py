"""Tensor-parallel linears and embeddings (Megatron-style), built for the group of
`distributed.group.current_tp()`; without one they are the plain layers they replace (the same
parameters and the same single op in `forward`).

    column-parallel  y_r = x W_r^T          W's output rows split: each rank computes its share
                                            (q/k/v heads, gate/up features); no communication
    row-parallel     y = sum_r x_r W_r^T    W's input columns split; an all-reduce sums the
                                            partial products (o_proj after attention, down_proj)
    vocab-parallel   each rank holds ceil(vocab / N) rows of the embedding / LM head; the
                     embedding all-reduces (rows outside the shard give zeros), the logits are
                     gathered side by side (`TPGroup.gather_vocab`)

FP8 (`quant` given, see runtime/quantization.py): the three linears hold `weight` as
float8_e4m3fn and a float32 `weight_scale` buffer [rows] (one scale per output row, sliced with its
rows: column-parallel shards take their rows' scales, row-parallel shards all of them). A 16/32-bit
checkpoint tensor is quantized as it loads (a row-parallel shard's scales then cover its columns,
as in SGLang and vLLM, which quantize each rank's shard); an FP8 one is copied as it is, and its
`weight_scale` (per channel, or per tensor: spread over the block's rows) loads beside it.

Every sharded parameter is loaded through its layer's `load(param_name, source, shard)` from the
full checkpoint tensor (or a lazy `CheckpointSlice`, so a rank reads only its slice), and
`full_shape(param_name)` is its shape without parallelism (random weights are drawn full, then
sliced, so that every tensor-parallel size gets the same model).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from lmnb.runtime.distributed.group import TPGroup, current_tp
from lmnb.runtime.models.layers import fp8
from lmnb.runtime.models.layers.activation import GatedActivation
from lmnb.runtime.models.layers.fusion import Fusable
from lmnb.runtime.models.layers.norm import RMSNorm
from lmnb.runtime.models.layers.rotary import RotaryEmbedding
from lmnb.runtime.models.layers.weights import (
    WeightSource,
    copy_weight,
    materialize,
)

if TYPE_CHECKING:
    from lmnb.runtime.config import ModelConfig
    from lmnb.runtime.quantization import Fp8Config


class HeadSplit(NamedTuple):
    """The attention heads one rank computes: query heads `q_start ...` (q_heads of them) and KV
    heads `kv_start ...` (kv_heads of them; one replicated head when the group outnumbers them)."""

    q_start: int
    q_heads: int
    kv_start: int
    kv_heads: int


def head_split(num_heads: int, num_kv_heads: int, *, rank: int = 0, size: int = 1) -> HeadSplit:
    """Query heads split evenly; KV heads split evenly when there are at least `size` of them,
    else each rank keeps the one KV head its query heads read (GQA groups stay whole)."""
    check_tp_heads(num_heads, num_kv_heads, size)
    q_heads = num_heads // size
    if num_kv_heads >= size:
        kv_heads = num_kv_heads // size
        return HeadSplit(rank * q_heads, q_heads, rank * kv_heads, kv_heads)
    return HeadSplit(rank * q_heads, q_heads, rank * num_kv_heads // size, 1)


def check_tp_heads(num_heads: int, num_kv_heads: int, size: int) -> None:
    if num_heads % size:
        raise ValueError(f"tp_size={size} does not divide the model's {num_heads} attention heads")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(f"tp_size={size} neither divides nor is a multiple of the model's "
                         f"{num_kv_heads} KV heads")


def check_tp_model(config: ModelConfig, size: int) -> None:
    """ValueError unless `size` ranks can share the model's heads and MLP features."""
    check_tp_heads(config.num_heads, config.num_kv_heads, size)
    _check_even("the MLP's intermediate size", config.intermediate_size, size)


def _rank_size(tp: TPGroup | None) -> tuple[int, int]:
    return (0, 1) if tp is None else (tp.rank, tp.size)


def _check_even(what: str, total: int, size: int) -> int:
    if total % size:
        raise ValueError(f"tp_size={size} does not divide {what} ({total})")
    return total // size


SKINNY_MAX_ROWS = fp8.SKINNY_MAX_ROWS
# Ablation switch (bench/fp8.py's "fp8-unfused" variant; read when a forward runs, so set it
# before a Runtime captures its CUDA graphs): False runs decode's RMSNorms and SiLU-and-mul as
# their own kernels beside the FP8 skinny GEMMs.
FP8_DECODE_FUSIONS = True
# Ablation switch (bench/fp8.py's "fp8-quant-apart" variant; read as FP8_DECODE_FUSIONS): False
# quantizes the W8A8 GEMMs' inputs in their own kernel (`per_token_quant`) instead of in the
# RMSNorm / SiLU-and-mul kernel in front (`RMSNorm.forward_fp8`, `GatedActivation.forward_fp8`).
FP8_QUANT_FUSIONS = True


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
           fused: bool, weight_scale: torch.Tensor | None = None,
           weight_only: bool = False) -> torch.Tensor:
    """F.linear, or with `fused` and at most SKINNY_MAX_ROWS rows (decode) the skinny-GEMM Triton
    kernel, which streams the weight at close to the HBM read bandwidth (cuBLAS reaches ~80%
    of it at batch 1). x [..., K], weight [N, K] -> [..., N]. With `weight_scale` the weight is
    FP8 (`fp8.fp8_linear`; `weight_only`: W8A16)."""
    if weight_scale is not None:
        return fp8.fp8_linear(x, weight, weight_scale, bias, fused=fused,
                              weight_only=weight_only)
    rows = x.numel() // max(x.shape[-1], 1)
    if not fused or not 1 <= rows <= SKINNY_MAX_ROWS or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    from lmnb.runtime.kernels.fused.gemv import skinny_linear

    out = skinny_linear(x.reshape(rows, x.shape[-1]).contiguous(), weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


class FusableLinear(nn.Linear, Fusable):
    """nn.Linear whose forward takes the skinny kernel for few rows when fused; FP8 after
    `use_fp8` (`weight_scale` is then its [out_features] float32 scales, else None)."""

    weight_scale: torch.Tensor | None
    fp8_weight_only: bool = False  # W8A16: activations stay 16-bit

    def __init__(self, in_features: int, out_features: int, *, bias: bool) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.register_buffer("weight_scale", None)

    def use_fp8(self, quant: Fp8Config | None) -> None:
        """Store the weight as FP8 with per-row scales (a no-op without `quant`)."""
        if quant is None:
            return
        self.fp8_weight_only = quant.weight_only
        self.weight = nn.Parameter(torch.zeros(self.weight.shape, dtype=fp8.FP8,
                                               device=self.weight.device), requires_grad=False)
        self.register_buffer("weight_scale", torch.ones(self.out_features, dtype=torch.float32,
                                                        device=self.weight.device))

    def forward(self, x: torch.Tensor | fp8.Fp8Rows) -> torch.Tensor:
        """x [..., K] -> [..., N]; or rows quantized in front (where `takes_fp8_rows`)."""
        return self._project(x, self.bias)

    def _project(self, x: torch.Tensor | fp8.Fp8Rows, bias: torch.Tensor | None
                 ) -> torch.Tensor:
        if isinstance(x, fp8.Fp8Rows):
            assert self.weight_scale is not None, "FP8 rows reach FP8 layers only"
            return fp8.fp8_rows_linear(x, self.weight, self.weight_scale, bias)
        return linear(x, self.weight, bias, fused=self.fused, weight_scale=self.weight_scale,
                      weight_only=self.fp8_weight_only)

    def takes_fp8_rows(self, rows: int, device: torch.device) -> bool:
        """Whether `forward` over `rows` rows on `device` quantizes them per token (fused W8A8,
        more rows than the skinny path), so that the kernel in front may emit them quantized
        (`fp8.Fp8Rows`, while `FP8_QUANT_FUSIONS`)."""
        return (FP8_QUANT_FUSIONS and self.fused and self.weight_scale is not None
                and fp8.quantizes_tokens(rows, self.weight, device, fused=True,
                                         weight_only=self.fp8_weight_only))

    def load_rows(self, param_name: str, rows: slice, source: WeightSource, name: str) -> None:
        """Checkpoint tensor `source` (already this rank's part) into rows `rows` of a parameter:
        the weight (16/32-bit: quantized here when the layer is FP8), its `weight_scale` ([n],
        [n, 1] or one per-tensor value) or `input_scale` (checked, unused: activations are
        quantized per token)."""
        start, length = rows.start, rows.stop - rows.start
        if param_name == "input_scale" and self.weight_scale is not None:
            if math.prod(source.shape) != 1:
                raise ValueError(f"{name}: input_scale of shape {tuple(source.shape)}, expected "
                                 "one per-tensor value")
            return
        if param_name == "weight_scale" and self.weight_scale is not None:
            target = self.weight_scale.narrow(0, start, length)
            if math.prod(source.shape) == 1:
                target.fill_(float(materialize(source).reshape(-1)[0]))
            else:
                copy_weight(target, materialize(source).reshape(-1), name)
            return
        param = getattr(self, param_name)
        target = param.narrow(0, start, length)
        if param_name != "weight" or self.weight_scale is None:
            copy_weight(target, source, name)
        elif source.dtype == fp8.FP8:
            copy_weight(target, source, name)
        else:
            if tuple(target.shape) != tuple(source.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(source.shape)} != model shape "
                                 f"{tuple(target.shape)}")
            quantized, scale = fp8.quantize_rows(
                materialize(source).to(device=target.device))
            target.copy_(quantized)
            self.weight_scale.narrow(0, start, length).copy_(scale)


class LogitsProjection(Fusable):
    """hidden [tokens, H] @ weight [vocab, H]^T for a weight owned elsewhere (the LM head's or the
    tied embedding's): the skinny kernel for few rows when fused. No parameters."""

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return linear(hidden, weight, None, fused=self.fused)


_SCALES = ("weight_scale", "input_scale")


class Block(NamedTuple):
    """One output block of a merged column-parallel weight: `size` rows from `start` of a
    checkpoint tensor of `full` rows."""

    full: int
    start: int
    size: int


class MergedColumnParallelLinear(FusableLinear):
    """Several linears of one input fused along the output (q/k/v, gate/up), each block's rows
    split across ranks; checkpoint shard `i` is block `i`. `output_sizes`: this rank's blocks."""

    def __init__(self, in_features: int, blocks: Sequence[Block], *, bias: bool,
                 quant: Fp8Config | None = None) -> None:
        self.blocks = tuple(blocks)
        self.output_sizes = tuple(b.size for b in self.blocks)
        super().__init__(in_features, sum(self.output_sizes), bias=bias)
        self.tp = current_tp()
        self.use_fp8(quant)

    @classmethod
    def even(cls, in_features: int, output_sizes: Sequence[int], *,
             bias: bool, quant: Fp8Config | None = None) -> MergedColumnParallelLinear:
        rank, size = _rank_size(current_tp())
        blocks = []
        for i, full in enumerate(output_sizes):
            share = _check_even(f"output block {i}", full, size)
            blocks.append(Block(full, rank * share, share))
        return cls(in_features, blocks, bias=bias, quant=quant)

    def _fp8_skinny(self, x: torch.Tensor) -> bool:
        """Whether x takes the fused FP8 skinny path (decode), where the fusions below run."""
        return (FP8_DECODE_FUSIONS and self.fused and self.weight_scale is not None
                and fp8.skinny_rows(x))

    def _fuses(self, act: GatedActivation) -> bool:
        return (act.fused and act.hidden_act == "silu" and len(self.output_sizes) == 2
                and self.output_sizes[0] == self.output_sizes[1])

    def forward_gated(self, x: torch.Tensor, act: GatedActivation, *, fp8_out: bool = False
                      ) -> torch.Tensor | fp8.Fp8Rows:
        """act(gate) * up over this layer's two equal output blocks (gate_up) -> [..., I]: one
        kernel (the activation in the GEMM's epilogue) where decode takes the fused FP8 skinny
        path with SiLU, else `act(self(x))`. `fp8_out` (the W8A8 layer behind `takes_fp8_rows`):
        the activation quantized per token in its kernel where `act.emits_fp8`."""
        if self._fp8_skinny(x) and self._fuses(act):
            return fp8.fp8_silu_linear(x, self.weight, self.weight_scale, self.bias)
        return self._activate(self(x), act, fp8_out)

    @staticmethod
    def _activate(out: torch.Tensor, act: GatedActivation, fp8_out: bool
                  ) -> torch.Tensor | fp8.Fp8Rows:
        return act.forward_fp8(out) if fp8_out and act.emits_fp8 and out.dim() == 2 else act(out)

    def forward_normed(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None,
                       act: GatedActivation | None = None, *, fp8_out: bool = False
                       ) -> tuple[torch.Tensor | fp8.Fp8Rows, torch.Tensor]:
        """`norm` in front of this layer (and `act` behind it: `forward_gated`, `fp8_out` as
        there) -> (out, the residual stream: x + residual, or x without a residual), as the
        pre-norm decoder passes them along. One kernel where decode takes the fused FP8 skinny
        path at one row (the norm in the GEMM's prologue: `fp8.norm_prologue_rows`); the norm
        emitting FP8 rows where this layer `takes_fp8_rows`; else the norm's and the layer's
        own paths."""
        if (self._fp8_skinny(x) and fp8.norm_prologue_rows(x) and norm.fused
                and norm.weight.dtype == x.dtype and (act is None or self._fuses(act))):
            return fp8.fp8_norm_linear(x, residual, norm.weight, norm.eps, self.weight,
                                       self.weight_scale, self.bias, gated=act is not None)
        if (norm.fused and norm.weight.dtype == x.dtype and x.dim() == 2
                and self.takes_fp8_rows(x.shape[0], x.device)):
            rows, stream = norm.forward_fp8(x, residual)
            out, residual = self(rows), x if stream is None else stream
            return (out if act is None else self._activate(out, act, fp8_out)), residual
        if residual is None:
            normed, residual = norm(x), x
        else:
            normed, residual = norm(x, residual)
        if act is None:
            return self(normed), residual
        return self.forward_gated(normed, act, fp8_out=fp8_out), residual

    def full_shape(self, param_name: str) -> tuple[int, ...]:
        rows = sum(b.full for b in self.blocks)
        return (rows, self.in_features) if param_name == "weight" else (rows,)

    def shards(self) -> tuple[int, ...]:
        return tuple(range(len(self.blocks)))

    def load(self, param_name: str, source: WeightSource, shard: int | None, name: str) -> None:
        per_tensor = param_name in _SCALES and math.prod(source.shape) == 1
        if shard is None:  # already fused in the checkpoint (or drawn full): split it
            offset = 0
            for i, block in enumerate(self.blocks):
                self.load(param_name, source if per_tensor else
                          source.narrow(0, offset, block.full), i, name)
                offset += block.full
            return
        block = self.blocks[shard]
        start = sum(self.output_sizes[:shard])
        rows = slice(start, start + block.size)
        if per_tensor:
            self.load_rows(param_name, rows, source, name)
            return
        if source.shape[0] != block.full:
            raise ValueError(f"{name}: checkpoint shape {tuple(source.shape)}, expected "
                             f"{block.full} rows")
        self.load_rows(param_name, rows, source.narrow(0, block.start, block.size), name)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections fused; this rank's heads per `head_split` (`num_heads`,
    `num_kv_heads`: on this rank)."""

    def forward_normed_rotary(self, norm: RMSNorm, x: torch.Tensor,
                              residual: torch.Tensor | None, rotary: RotaryEmbedding,
                              positions: torch.Tensor, *,
                              kv_buffers: tuple[torch.Tensor, torch.Tensor],
                              slots: torch.Tensor,
                              kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`norm`, this projection and the fused rotary (k and v stored at `slots` of
        `kv_buffers`, an FP8 pool's with `kv_scales`, as `rotary.rotate_qkv(...)` does) as one
        kernel -> (q, the residual stream); None where that kernel does not run (other than
        decode's fused FP8 path at one row): the caller then takes `forward_normed` and the
        rotary apart."""
        if not (self._fp8_skinny(x) and fp8.norm_prologue_rows(x) and rotary.fused
                and norm.fused and norm.weight.dtype == x.dtype and x.dim() == 2):
            return None
        from lmnb.runtime.kernels.fused.gemv_fp8 import RotaryStore

        rope = RotaryStore(positions, rotary.cos, rotary.sin, self.num_heads, self.num_kv_heads,
                           rotary.head_dim, kv_buffers[0], kv_buffers[1], slots, kv_scales)
        return fp8.fp8_norm_rotary_linear(x, residual, norm.weight, norm.eps, self.weight,
                                          self.weight_scale, self.bias, rope=rope)

    def __init__(self, hidden_size: int, *, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, quant: Fp8Config | None = None) -> None:
        rank, size = _rank_size(current_tp())
        split = head_split(num_heads, num_kv_heads, rank=rank, size=size)
        self.num_heads, self.num_kv_heads = split.q_heads, split.kv_heads
        q = Block(num_heads * head_dim, split.q_start * head_dim, split.q_heads * head_dim)
        kv = Block(num_kv_heads * head_dim, split.kv_start * head_dim, split.kv_heads * head_dim)
        super().__init__(hidden_size, (q, kv, kv), bias=bias, quant=quant)


class RowParallelLinear(FusableLinear):
    """Input features split across ranks (the output of a column-parallel layer comes in split
    the same way); the partial outputs are summed by an all-reduce, the bias added once."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool,
                 quant: Fp8Config | None = None) -> None:
        self.tp = current_tp()
        rank, size = _rank_size(self.tp)
        share = _check_even("the input features", in_features, size)
        self.full_in_features = in_features
        self.in_start = rank * share
        super().__init__(share, out_features, bias=bias)
        self.use_fp8(quant)

    def forward(self, x: torch.Tensor | fp8.Fp8Rows) -> torch.Tensor:
        if self.tp is None:
            return self._project(x, self.bias)
        out = self._project(x, self.bias if self.tp.rank == 0 else None)
        return self.tp.all_reduce(out)

    def full_shape(self, param_name: str) -> tuple[int, ...]:
        if param_name == "weight":
            return (self.out_features, self.full_in_features)
        return (self.out_features,)

    def shards(self) -> tuple[None]:
        return (None,)

    def load(self, param_name: str, source: WeightSource, shard: int | None, name: str) -> None:
        if param_name == "weight":
            if tuple(source.shape) != self.full_shape("weight"):
                raise ValueError(f"{name}: checkpoint shape {tuple(source.shape)} != model shape "
                                 f"{self.full_shape('weight')}")
            source = source.narrow(1, self.in_start, self.in_features)
        # scales are per output row: every rank keeps all of them
        self.load_rows(param_name, slice(0, self.out_features), source, name)


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose rows (the vocabulary) are split across ranks: rank r holds ids
    `[r * per_rank, (r + 1) * per_rank)`, the last shard padded with zero rows. Also the LM
    head's weight (`ParallelLMHead`, tied embeddings)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp = current_tp()
        rank, size = _rank_size(self.tp)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.per_rank = math.ceil(num_embeddings / size)
        self.vocab_start = rank * self.per_rank
        self.vocab_end = min(self.vocab_start + self.per_rank, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim))
        nn.init.normal_(self.weight)  # as nn.Embedding (the loader skips random fills)
        if self.vocab_end - self.vocab_start < self.per_rank:
            with torch.no_grad():
                self.weight[max(self.vocab_end - self.vocab_start, 0):].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return F.embedding(input_ids, self.weight)
        inside = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(inside, input_ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight).masked_fill_(~inside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)

    def full_shape(self, param_name: str) -> tuple[int, ...]:
        return (self.num_embeddings, self.embedding_dim)

    def shards(self) -> tuple[None]:
        return (None,)

    def load(self, param_name: str, source: WeightSource, shard: int | None, name: str) -> None:
        if tuple(source.shape) != self.full_shape("weight"):
            raise ValueError(f"{name}: checkpoint shape {tuple(source.shape)} != model shape "
                             f"{self.full_shape('weight')}")
        rows = max(self.vocab_end - self.vocab_start, 0)
        copy_weight(self.weight.narrow(0, 0, rows), source.narrow(0, self.vocab_start, rows),
                    name)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows {self.vocab_start}:"
                f"{self.vocab_end}")


class ParallelLMHead(VocabParallelEmbedding):
    """The LM head's [vocab, hidden] weight split by vocabulary like the embedding; logits are
    computed per shard and gathered (`TPGroup.gather_vocab`)."""


SHARDED_LAYERS = (MergedColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)
