"""Llama-family decoder (Llama-2/3, Mistral, Qwen2, SmolLM2) over flattened tokens.

Tokens of every request in a batch are concatenated into one `[num_tokens, hidden]` tensor;
attention finds each request's KV through the `ForwardBatch`, in the pools of the attention
backend bound to the layers (`layers/attention.py`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from lmnb.runtime.config import ModelConfig
from lmnb.runtime.distributed.group import current_tp
from lmnb.runtime.forward_batch import ForwardBatch
from lmnb.runtime.models.layers.activation import GatedActivation
from lmnb.runtime.models.layers.attention import PooledAttention
from lmnb.runtime.models.layers.fp8 import FP8
from lmnb.runtime.models.layers.linear import (
    SHARDED_LAYERS,
    FusableLinear,
    LogitsProjection,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from lmnb.runtime.models.layers.norm import RMSNorm
from lmnb.runtime.models.layers.rotary import RotaryEmbedding, rope_inverse_frequencies
from lmnb.runtime.models.layers.weights import (
    WeightSource,
    copy_weight,
    kv_scale_place,
    scalar_scale,
)
from lmnb.runtime.models.registry import register_model
from lmnb.runtime.quantization import module_quantization

QKV = ("q_proj", "k_proj", "v_proj")

__all__ = ["LlamaForCausalLM", "LlamaModel", "RMSNorm", "RotaryEmbedding",
           "rope_inverse_frequencies"]


class LlamaAttention(PooledAttention):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = config.head_dim
        prefix = f"layers.{layer_id}.self_attn."
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head_dim=config.head_dim, num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads, bias=config.qkv_bias,
            quant=module_quantization(config.quantization, [prefix + p for p in QKV]))
        # Heads of this tensor-parallel rank (all of them without parallelism).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.split_sizes = self.qkv_proj.output_sizes
        self.o_proj = RowParallelLinear(
            config.num_heads * self.head_dim, config.hidden_size, bias=config.o_bias,
            quant=module_quantization(config.quantization, [prefix + "o_proj"]))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, rotary: RotaryEmbedding,
                forward_batch: ForwardBatch) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(hidden), rotary, forward_batch)

    def forward_normed(self, norm: RMSNorm, positions: torch.Tensor, hidden: torch.Tensor,
                       residual: torch.Tensor | None, rotary: RotaryEmbedding,
                       forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward(norm(hidden, residual))` -> (out, the residual stream); the norm may run
        inside the qkv GEMM (`MergedColumnParallelLinear.forward_normed`), and the rotary too
        (`QKVParallelLinear.forward_normed_rotary`)."""
        storage = self.attn_backend.kv_storage
        if rotary.fused:
            fused = self.qkv_proj.forward_normed_rotary(
                norm, hidden, residual, rotary, positions,
                kv_buffers=(storage.k_buffers[self.layer_id], storage.v_buffers[self.layer_id]),
                slots=forward_batch.out_cache_loc, kv_scales=storage.scales(self.layer_id))
            if fused is not None:
                q, residual = fused
                out = self.attn_backend.forward(q, None, None, self.layer_id, forward_batch,
                                                save_kv=False)
                return self.o_proj(out), residual
        qkv, residual = self.qkv_proj.forward_normed(norm, hidden, residual)
        return self.attend(positions, qkv, rotary, forward_batch), residual

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, rotary: RotaryEmbedding,
               forward_batch: ForwardBatch) -> torch.Tensor:
        """Rotary, attention and o_proj over the qkv projection's output."""
        backend = self.attn_backend
        if rotary.fused:  # one kernel: rotate q and k, store k and v in the KV pool
            storage = backend.kv_storage
            q, _, _ = rotary.rotate_qkv(
                positions, qkv, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                kv_buffers=(storage.k_buffers[self.layer_id], storage.v_buffers[self.layer_id]),
                slots=forward_batch.out_cache_loc, kv_scales=storage.scales(self.layer_id))
            out = backend.forward(q, None, None, self.layer_id, forward_batch, save_kv=False)
        else:
            q, k, v = rotary.rotate_qkv(positions, qkv, num_heads=self.num_heads,
                                        num_kv_heads=self.num_kv_heads)
            out = backend.forward(q, k, v, self.layer_id, forward_batch)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        bias = config.mlp_bias
        prefix = f"layers.{layer_id}.mlp."
        self.gate_up_proj = MergedColumnParallelLinear.even(
            config.hidden_size, (config.intermediate_size,) * 2, bias=bias,
            quant=module_quantization(config.quantization, [prefix + "gate_proj",
                                                            prefix + "up_proj"]))
        self.intermediate_size = self.gate_up_proj.output_sizes[0]  # this rank's share
        self.down_proj = RowParallelLinear(
            config.intermediate_size, config.hidden_size, bias=bias,
            quant=module_quantization(config.quantization, [prefix + "down_proj"]))
        self.act_fn = GatedActivation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.forward_gated(x, self.act_fn))

    def forward_normed(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward(norm(x, residual))` -> (out, the residual stream); norm, gate_up and the
        activation may run as one kernel (`MergedColumnParallelLinear.forward_normed`); for a
        W8A8 down_proj the activation's kernel quantizes its output (`takes_fp8_rows`)."""
        fp8_out = x.dim() == 2 and self.down_proj.takes_fp8_rows(x.shape[0], x.device)
        act, residual = self.gate_up_proj.forward_normed(norm, x, residual, act=self.act_fn,
                                                         fp8_out=fp8_out)
        return self.down_proj(act), residual


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block passing the residual stream along (`hidden, residual`), so that each
    residual add happens inside the next RMSNorm (one fused kernel on CUDA)."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id)
        self.mlp = LlamaMLP(config, layer_id)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, rotary: RotaryEmbedding,
                forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (this layer's MLP output, the residual stream before it); their sum is the
        layer's output hidden state. `residual` None: the first layer (hidden is the stream)."""
        hidden, residual = self.self_attn.forward_normed(self.input_layernorm, positions, hidden,
                                                         residual, rotary, forward_batch)
        return self.mlp.forward_normed(self.post_attention_layernorm, hidden, residual)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: ForwardBatch,
                input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, self.rotary, forward_batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden


@register_model("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "llama", "mistral",
                "qwen2", tensor_parallel=True)  # `tp_size > 1` shards it (models/layers/linear.py)
class LlamaForCausalLM(nn.Module):
    """Causal LM head over `LlamaModel`; parameter names follow HF, with q/k/v and gate/up fused."""

    _FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tp = current_tp()
        self.model = LlamaModel(config)
        self.tie_word_embeddings = config.tie_word_embeddings
        if self.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.logits_projection = LogitsProjection()  # the skinny kernel at decode when fused

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: ForwardBatch,
                input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Returns the final hidden states [num_tokens, hidden]; see `compute_logits`.
        `input_embeds` [num_tokens, hidden], when given, replaces the token embedding."""
        return self.model(input_ids, positions, forward_batch, input_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[tokens, vocab] logits in the model's dtype (the sampler reads bf16 rows as they are;
        a [234, 128k] fp32 copy per decode step costs as much as reading them twice)."""
        logits = self.logits_projection(hidden, self.lm_head_weight)
        if self.tp is not None:  # this rank's vocabulary shard -> all of it, on every rank
            logits = self.tp.gather_vocab(logits, self.config.vocab_size)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> None:
        """HF-named checkpoint tensors (or lazy `CheckpointSlice`s: a tensor-parallel rank reads
        only its slices) into the parameters; every parameter must be filled. FP8 layers also
        take `weight_scale` (required beside an FP8 weight) and `input_scale` (unused)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        needed: set[str] = set()  # scales of FP8 checkpoint weights
        kv_scales: dict[str, list[float | None]] = {}  # attention module -> [k, v]
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if (kv_scale := kv_scale_place(name)) is not None:
                attention, which = kv_scale
                kv_scales.setdefault(attention, [None, None])[which] = scalar_scale(tensor, name)
                continue
            if name.startswith("lm_head.") and self.tie_word_embeddings:
                continue
            target, shard = name, None
            for hf_name, (fused_name, shard_id) in self._FUSED.items():
                if f".{hf_name}." in name:
                    target, shard = name.replace(hf_name, fused_name), shard_id
                    break
            module_name, _, param_name = target.rpartition(".")
            if target not in params and not self._is_fp8_scale(module_name, param_name):
                raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            module = self.get_submodule(module_name)
            if param_name == "weight" and tensor.dtype == FP8:
                needed.add(f"{module_name}.weight_scale#{shard}")
            with torch.no_grad():
                if isinstance(module, SHARDED_LAYERS):
                    module.load(param_name, tensor, shard, name)
                else:
                    copy_weight(params[target], tensor, name)
            loaded.add(f"{target}#{shard}")
        expected = {f"{n}#{s}" for n in params for s in self._shards_of(n)} | needed
        missing = sorted(expected - loaded)
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
        self._set_kv_scales(kv_scales)

    def _set_kv_scales(self, kv_scales: dict[str, list[float | None]]) -> None:
        """The checkpoint's FP8 KV scales onto the attention layers: every layer's K and V, or
        none (`PooledAttention.kv_scales`)."""
        if not kv_scales:
            return
        layers = {name: m for name, m in self.named_modules() if isinstance(m, PooledAttention)}
        if set(kv_scales) != set(layers):
            raise KeyError(f"checkpoint has FP8 KV scales for {len(kv_scales)} of "
                           f"{len(layers)} attention layers (e.g. {sorted(kv_scales)[:2]})")
        for name, (k, v) in kv_scales.items():
            if k is None or v is None:
                raise KeyError(f"checkpoint has {name}'s {'v' if k is None else 'k'}_scale "
                               f"without its {'k' if k is None else 'v'}_scale")
            layers[name].kv_scales = (k, v)

    def _is_fp8_scale(self, module_name: str, param_name: str) -> bool:
        if param_name not in ("weight_scale", "input_scale"):
            return False
        try:
            module = self.get_submodule(module_name)
        except AttributeError:
            return False
        return isinstance(module, FusableLinear) and module.weight_scale is not None

    def _shards_of(self, name: str) -> tuple[int | None, ...]:
        module = self.get_submodule(name.rpartition(".")[0])
        return module.shards() if isinstance(module, MergedColumnParallelLinear) else (None,)
