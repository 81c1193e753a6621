"""Llama-family decoder (Llama-2/3, Mistral, Qwen2, SmolLM2) over flattened tokens.

Tokens of every request in a batch are concatenated into one `[num_tokens, hidden]` tensor;
attention finds each request's KV through the `ForwardBatch`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from lmnb.runtime.config import ModelConfig
from lmnb.runtime.forward_batch import ForwardBatch
from lmnb.runtime.models.registry import register_model

_ACTIVATIONS = {"silu": nn.functional.silu, "gelu": nn.functional.gelu,
                "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh")}


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    head_dim = config.head_dim
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    params = config.rope_scaling
    if params is None:
        return inv_freq
    rope_type = params["rope_type"]
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        factor = params["factor"]
        low_freq_factor, high_freq_factor = params["low_freq_factor"], params["high_freq_factor"]
        old_context_len = params["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = ((old_context_len / wavelen - low_freq_factor)
                  / (high_freq_factor - low_freq_factor))
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"rope type {rope_type!r} is not supported (default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding with a precomputed cos/sin table over all positions."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq = rope_inverse_frequencies(config)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self.head_dim = config.head_dim

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q [num_tokens, heads, dim], k [num_tokens, kv_heads, dim]
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return (q * cos + self._rotate_half(q) * sin,
                k * cos + self._rotate_half(k) * sin)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.split_sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_bias)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, rotary: RotaryEmbedding,
                forward_batch: ForwardBatch) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split(self.split_sizes, dim=-1)
        q, k = rotary(positions, q.view(num_tokens, self.num_heads, self.head_dim),
                      k.view(num_tokens, self.num_kv_heads, self.head_dim))
        out = forward_batch.attn_backend.forward(q.reshape(num_tokens, -1),
                                                 k.reshape(num_tokens, -1), v,
                                                 self.layer_id, forward_batch)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        bias = config.mlp_bias
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        if config.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported "
                             f"({', '.join(_ACTIVATIONS)})")
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, rotary: RotaryEmbedding,
                forward_batch: ForwardBatch) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), rotary,
                                         forward_batch)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: ForwardBatch,
                input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        for layer in self.layers:
            hidden = layer(positions, hidden, self.rotary, forward_batch)
        return self.norm(hidden)


@register_model("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "llama", "mistral",
                "qwen2")
class LlamaForCausalLM(nn.Module):
    """Causal LM head over `LlamaModel`; parameter names follow HF, with q/k/v and gate/up fused."""

    _FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.tie_word_embeddings = config.tie_word_embeddings
        if self.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

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
        return nn.functional.linear(hidden, self.lm_head_weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name.startswith("lm_head.") and self.tie_word_embeddings:
                continue
            target, shard = name, None
            for hf_name, (fused_name, shard_id) in self._FUSED.items():
                if f".{hf_name}." in name:
                    target, shard = name.replace(hf_name, fused_name), shard_id
                    break
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            param = params[target]
            with torch.no_grad():
                if shard is None:
                    _copy_checked(param, tensor, name)
                else:
                    _copy_checked(self._shard_view(target, param, shard), tensor, name)
            loaded.add(f"{target}#{shard}")
        expected = {f"{n}#{s}" for n in params for s in self._shards_of(n)}
        missing = sorted(expected - loaded)
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

    def _shards_of(self, name: str) -> tuple[int | None, ...]:
        if ".qkv_proj." in name:
            return (0, 1, 2)
        if ".gate_up_proj." in name:
            return (0, 1)
        return (None,)

    def _shard_view(self, name: str, param: torch.Tensor, shard: int) -> torch.Tensor:
        if ".qkv_proj." in name:
            layer = int(name.split(".")[2])
            sizes = self.model.layers[layer].self_attn.split_sizes
        else:
            sizes = (self.config.intermediate_size,) * 2
        start = sum(sizes[:shard])
        return param.narrow(0, start, sizes[shard])


def _copy_checked(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape "
                         f"{tuple(param.shape)}")
    param.copy_(tensor)
