"""The Llama-family decoder (Llama, Llama 3, Qwen2, Mistral) over a paged KV cache.

Parameter names equal Hugging Face's, so a loaded state dict maps one to one. The model works on a
flat batch of tokens from many requests (``[num_tokens, hidden]``); which token belongs to which
request is only known to attention, through the step's metadata, which each layer hands to the
attention implementation chosen for the backend (``runner/attention/``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshserve.config import ModelConfig
from meshserve.runner.attention import AttentionBackend, AttentionMetadata


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back before the weight, as transformers does.
        normed = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)
        return self.weight * normed.to(x.dtype)


class Rotary(nn.Module):
    """Rotary position embedding; cos/sin are tabled once for every position."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, max_positions: int) -> None:
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.float()[None, :]  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> "RotaryAngles":
        """cos/sin of this step's positions, gathered once and shared by every layer."""
        return (self.cos[positions].to(dtype)[:, None, :],  # [T, 1, D]
                self.sin[positions].to(dtype)[:, None, :])


RotaryAngles = tuple[torch.Tensor, torch.Tensor]


def apply_rotary(x: torch.Tensor, angles: RotaryAngles) -> torch.Tensor:
    cos, sin = angles
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _fuse_linears(parts: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the parts' outputs side by side."""
    fused = nn.Linear(parts[0].in_features, sum(p.out_features for p in parts),
                      bias=parts[0].bias is not None, device=parts[0].weight.device,
                      dtype=parts[0].weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    return fused.requires_grad_(False)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, impl: AttentionBackend) -> None:
        super().__init__()
        self.impl = impl
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim ** -0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.qkv_proj: nn.Linear | None = None
        self.kv_cache: Any = None  # this layer's cache as the implementation binds it

    def fuse(self) -> None:
        """Replace q/k/v by one projection: fewer, larger matmuls for an unsharded backend."""
        self.qkv_proj = _fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv_proj is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        kv = self.num_kv_heads * self.head_dim
        return self.qkv_proj(x).split([self.num_heads * self.head_dim, kv, kv], dim=-1)

    def forward(self, x: torch.Tensor, angles: RotaryAngles,
                meta: AttentionMetadata) -> tuple[torch.Tensor, Any]:
        tokens = x.shape[0]
        q, k, v = self._project(x)
        q = apply_rotary(q.view(tokens, -1, self.head_dim), angles)  # [T, H, D]
        k = apply_rotary(k.view(tokens, -1, self.head_dim), angles)  # [T, Hkv, D]
        v = v.view(tokens, -1, self.head_dim)
        out, cache = self.impl.forward(q, k, v, self.kv_cache, meta, self.scale)  # [T, H, D]
        return self.o_proj(out.reshape(tokens, -1)), cache


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gate_up_proj: nn.Linear | None = None

    def fuse(self) -> None:
        self.gate_up_proj = _fuse_linears([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attention: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = Attention(config, attention)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, angles: RotaryAngles,
                meta: AttentionMetadata) -> tuple[torch.Tensor, Any]:
        attended, cache = self.self_attn(self.input_layernorm(x), angles, meta)
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig, attention: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, attention)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """``forward`` gives hidden states of every token, and each layer's cache as it stands after
    the step's writes (the same handles where attention writes in place, new tensors on xla,
    which the caller binds for the next step); ``compute_logits`` only of the rows asked."""

    def __init__(self, config: ModelConfig, rotary: Rotary, attention: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config, attention)
        self.rotary = rotary
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, tuple[Any, ...]]:
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        angles = self.rotary.lookup(positions, x.dtype)
        caches = []
        for layer in self.model.layers:
            x, cache = layer(x, angles, meta)
            caches.append(cache)
        return self.model.norm(x), tuple(caches)

    def bind_kv_caches(self, caches: Sequence[Any]) -> None:
        """Give each layer its cache (``AttentionBackend.bind_cache``'s handle), in layer order."""
        for layer, cache in zip(self.model.layers, caches, strict=True):
            layer.self_attn.kv_cache = cache

    def fuse_projections(self, gate_up: bool = True) -> None:
        """Fuse q/k/v matmuls, and gate/up ones unless ``gate_up`` is False (for backends that do
        not shard the weights)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            if gate_up:
                layer.mlp.fuse()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = (self.model.embed_tokens.weight if self.config.tie_word_embeddings
                  else self.lm_head.weight)
        return F.linear(hidden, weight).float()  # [R, vocab]
