"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, and with experts Mixtral, Qwen2-MoE, Qwen3-MoE) over
packed tokens and a paged KV cache.

Module and parameter names mirror the HF checkpoints, so weights load by name. Tokens of all
requests in a step are packed along one axis; attention reads and writes the paged cache
through an `AttentionMetadata` passed down explicitly.
"""

from dataclasses import dataclass

import torch
from torch import nn

from engine.models.layers import Linear, PackedLinear, RMSNorm
from engine.models.moe import MoeConfig, SparseMoeBlock
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
    moe: MoeConfig | None = None  # mixture-of-experts feed-forward blocks on its `sparse_layers`
    # (checkpoint spelling, kvserve's) substitutions applied to weight names, e.g. Mixtral's
    # `block_sparse_moe.experts.0.w1` for `mlp.experts.0.gate_proj`.
    checkpoint_renames: tuple[tuple[str, str], ...] = ()


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
        self.qkv_proj = PackedLinear(
            hidden, {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}, bias=config.qkv_bias
        )
        self.o_proj = Linear(q_size, hidden, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.rotary = rotary
        self.scale = config.head_dim**-0.5

    def forward(self, hidden, positions, kv_cache: PagedKV, metadata, backend: AttentionBackend):
        num_tokens = hidden.shape[0]
        query, key, value = self.qkv_proj.split(hidden)
        query = query.view(num_tokens, self.num_heads, self.head_dim)
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            query, key = self.q_norm(query, backend), self.k_norm(key, backend)
        query, key = self.rotary(positions, query, key, backend)
        backend.store_kv(key, value, kv_cache, metadata.slot_mapping)
        out = backend.paged_attention(query, kv_cache, metadata, self.scale)
        return self.o_proj(out.reshape(num_tokens, -1))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        size = intermediate_size
        self.gate_up_proj = PackedLinear(hidden_size, {"gate_proj": size, "up_proj": size}, bias=bias)
        self.down_proj = Linear(size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        return self.down_proj(backend.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig, rotary: RotaryEmbedding, index: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, rotary)
        if config.moe is not None and index in config.moe.sparse_layers:
            self.mlp = SparseMoeBlock(config.hidden_size, config.moe, MLP)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, residual, positions, kv_cache, metadata, backend):
        """(this layer's output, the residual stream before it); the next norm adds the two."""
        if residual is None:  # the first layer: the embeddings are the residual stream
            hidden, residual = self.input_layernorm(hidden, backend), hidden
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual, backend)
        hidden = self.self_attn(hidden, positions, kv_cache, metadata, backend)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual, backend)
        return self.mlp(hidden, backend), residual


class DecoderModel(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        # One rotary table shared by all layers (a buffer, not a checkpoint weight).
        self.rotary = RotaryEmbedding(config.rope, config.max_position_embeddings)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, self.rotary, index) for index in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DecoderForCausalLM(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """With tied embeddings the LM head is the embedding matrix (again after the model is moved or allocated)."""
        if self.config.tie_word_embeddings:
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
        hidden, residual = self.model.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, positions, kv_cache, metadata, backend)
        return self.model.norm.add_and_norm(hidden, residual, backend)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
