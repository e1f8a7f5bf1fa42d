"""The Llama-family decoder (Llama, Llama 3, Qwen2, Mistral) over a paged KV cache.

Parameter names equal Hugging Face's, so a loaded state dict maps one to one. The model works on a
flat batch of tokens from many requests (``[num_tokens, hidden]``); which token belongs to which
request is only known to attention, through ``AttentionMetadata``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshserve.config import ModelConfig
from meshserve.runner.attention import AttentionMetadata, torch_paged_attention, write_kv

KVCache = tuple[torch.Tensor, torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back before the weight, as transformers does.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """Rotary position embedding; cos/sin are tabled once for every position."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, max_positions: int) -> None:
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.float()[None, :]  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].to(q.dtype)[:, None, :]  # [T, 1, D]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim ** -0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, rotary: Rotary) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, -1, self.head_dim)  # [T, H, D]
        k = self.k_proj(x).view(tokens, -1, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x).view(tokens, -1, self.head_dim)
        q, k = rotary(q, k, positions)
        write_kv(kv_cache[0], kv_cache[1], k, v, meta.slot_mapping)
        out = torch_paged_attention(q, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.reshape(tokens, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, rotary: Rotary) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, kv_cache, meta, rotary)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """``forward`` gives hidden states of every token; ``compute_logits`` only of those asked."""

    def __init__(self, config: ModelConfig, rotary: Rotary) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.rotary = rotary
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x = layer(x, positions, kv_cache, meta, self.rotary)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = (self.model.embed_tokens.weight if self.config.tie_word_embeddings
                  else self.lm_head.weight)
        return F.linear(hidden, weight).float()  # [R, vocab]
