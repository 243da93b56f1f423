"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over packed tokens and a paged KV cache.

Module and parameter names mirror the HF checkpoints, so weights load by name. Tokens of all
requests in a step are packed along one axis; attention reads and writes the paged cache
through an `AttentionMetadata` passed down explicitly.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.rope import RopeConfig, RotaryEmbedding
from kernels import AttentionBackend, AttentionMetadata, PagedKV


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    o_proj_bias: bool = False  # Llama's attention_bias also covers o_proj
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before rope


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like the reference implementations, then cast back.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        hidden, q_size, kv_size = (
            config.hidden_size,
            config.num_heads * config.head_dim,
            config.num_kv_heads * config.head_dim,
        )
        self.q_proj = nn.Linear(hidden, q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.rotary = rotary
        self.scale = config.head_dim**-0.5

    def forward(self, hidden, positions, kv_cache: PagedKV, metadata, backend: AttentionBackend):
        num_tokens = hidden.shape[0]
        query = self.q_proj(hidden).view(num_tokens, self.num_heads, self.head_dim)
        key = self.k_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        value = self.v_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = self.rotary(positions, query, key)
        backend.store_kv(key, value, kv_cache, metadata.slot_mapping)
        out = backend.paged_attention(query, kv_cache, metadata, self.scale)
        return self.o_proj(out.reshape(num_tokens, -1))


class MLP(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Attention(config, rotary)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, positions, kv_cache, metadata, backend):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), positions, kv_cache, metadata, backend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DecoderModel(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        # One rotary table shared by all layers (a buffer, not a checkpoint weight).
        rotary = RotaryEmbedding(config.rope, config.max_position_embeddings)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, rotary) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DecoderForCausalLM(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[PagedKV],
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden_size] of the packed tokens after the final norm."""
        hidden = self.model.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden = layer(hidden, positions, kv_cache, metadata, backend)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
