"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3; with experts Mixtral, Qwen2-MoE, Qwen3-MoE;
with Gemma's switches Gemma 2 and Gemma 3) over packed tokens and a paged KV cache.

Module and parameter names mirror the HF checkpoints, so weights load by name. Tokens of all
requests in a step are packed along one axis; attention reads and writes the paged cache
through an `AttentionMetadata` passed down explicitly.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.engine.models.layers import (
    Linear,
    PackedLinear,
    QuantizedEmbedding,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from kvserve.engine.models.moe import MoeConfig, SparseMoeBlock
from kvserve.engine.models.rope import RopeConfig, RotaryEmbedding
from kvserve.engine.parallel.group import TensorParallelGroup
from kvserve.engine.parallel.sharding import ShardPlan
from kvserve.kernels import AttentionMetadata, KernelBackend, PagedKV


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
    # Gemma 2 and 3
    hidden_act: str = "silu"  # or "gelu_pytorch_tanh": GeGLU
    norm_weight_offset: float = 0.0  # Gemma's RMSNorm scales by (1 + weight): the loader adds the 1
    embedding_scale: float = 1.0  # Gemma: the embeddings times sqrt(hidden_size)
    sandwich_norms: bool = False  # Gemma: the attention output normed, and the MLP between two norms
    attention_scale: float | None = None  # default head_dim ** -0.5; Gemma: query_pre_attn_scalar ** -0.5
    attention_softcap: float | None = None  # Gemma 2: scores become cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: the same on the logits
    sliding_windows: tuple[int | None, ...] = ()  # per layer (None: the whole context); empty: no windows
    local_rope: RopeConfig | None = None  # Gemma 3: the rope of the sliding-window layers

    def sliding_window(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None


def _row_parallel(in_features: int, out_features: int, bias: bool, group: TensorParallelGroup | None) -> Linear:
    if group is None:
        return Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, group)


class Attention(nn.Module):
    """Self-attention over this rank's heads (all of them without tensor parallelism)."""

    def __init__(
        self, config: DecoderConfig, rotary: RotaryEmbedding, sliding_window: int | None, plan: ShardPlan,
        group: TensorParallelGroup | None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = plan.num_heads, plan.num_kv_heads, config.head_dim
        hidden, q_size, kv_size = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = PackedLinear(
            hidden, {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}, bias=config.qkv_bias
        )
        self.o_proj = _row_parallel(q_size, hidden, config.o_proj_bias, group)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.rotary = rotary
        self.scale = config.attention_scale or config.head_dim**-0.5
        self.sliding_window = sliding_window
        self.softcap = config.attention_softcap

    def forward(self, hidden, positions, kv_cache: PagedKV, metadata, backend: KernelBackend):
        num_tokens = hidden.shape[0]
        query, key, value = self.qkv_proj.split(hidden, backend)
        query = query.view(num_tokens, self.num_heads, self.head_dim)
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            query, key = self.q_norm(query, backend), self.k_norm(key, backend)
        query, key = self.rotary(positions, query, key, backend)
        backend.store_kv(key, value, kv_cache, metadata.slot_mapping)
        out = backend.paged_attention(query, kv_cache, metadata, self.scale, self.sliding_window, self.softcap)
        return self.o_proj(out.reshape(num_tokens, -1), backend)


class MLP(nn.Module):
    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool, hidden_act: str = "silu",
        group: TensorParallelGroup | None = None,
    ) -> None:  # fmt: skip
        """`intermediate_size`: this rank's share with a tensor-parallel `group`."""
        super().__init__()
        size = intermediate_size
        self.gate_up_proj = PackedLinear(hidden_size, {"gate_proj": size, "up_proj": size}, bias=bias)
        self.down_proj = _row_parallel(size, hidden_size, bias, group)
        self.gelu = hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor, backend: KernelBackend) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, backend)
        if self.gelu:  # GeGLU (Gemma): a torch op, no fused kernel
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh") * up, backend)
        return self.down_proj(backend.silu_and_mul(gate_up), backend)


class DecoderLayer(nn.Module):
    def __init__(
        self, config: DecoderConfig, rotary: RotaryEmbedding, index: int, plan: ShardPlan,
        group: TensorParallelGroup | None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.self_attn = Attention(config, rotary, config.sliding_window(index), plan, group)
        if config.moe is not None and index in config.moe.sparse_layers:
            self.mlp = SparseMoeBlock(config.hidden_size, config.moe, MLP, plan, group)
        else:
            self.mlp = MLP(config.hidden_size, plan.intermediate_size, config.mlp_bias, config.hidden_act, group)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.sandwich_norms = config.sandwich_norms
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, residual, positions, kv_cache, metadata, backend):
        """(this layer's output, the residual stream before it); the next norm adds the two."""
        if residual is None:  # the first layer: the embeddings are the residual stream
            hidden, residual = self.input_layernorm(hidden, backend), hidden
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual, backend)
        hidden = self.self_attn(hidden, positions, kv_cache, metadata, backend)
        if not self.sandwich_norms:
            hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual, backend)
            return self.mlp(hidden, backend), residual
        # Gemma: post_attention_layernorm norms the attention output before it joins the residual stream.
        hidden = self.post_attention_layernorm(hidden, backend)
        hidden, residual = self.pre_feedforward_layernorm.add_and_norm(hidden, residual, backend)
        return self.post_feedforward_layernorm(self.mlp(hidden, backend), backend), residual


class DecoderModel(nn.Module):
    def __init__(self, config: DecoderConfig, plan: ShardPlan, group: TensorParallelGroup | None) -> None:
        super().__init__()
        # One rotary table shared by all layers (a buffer, not a checkpoint weight).
        self.rotary = RotaryEmbedding(config.rope, config.max_position_embeddings)
        # Gemma 3's sliding-window layers rotate with a rope of their own.
        if config.local_rope is not None:
            self.local_rotary = RotaryEmbedding(config.local_rope, config.max_position_embeddings)
        if group is None:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        else:
            self.embed_tokens = VocabParallelEmbedding(
                plan.vocab_rows, config.hidden_size, plan.first_vocab_row, plan.num_real_vocab_rows, group
            )
        self.layers = nn.ModuleList(
            DecoderLayer(config, self.rotary_of_layer(config, index), index, plan, group)
            for index in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def rotary_of_layer(self, config: DecoderConfig, index: int) -> RotaryEmbedding:
        if config.local_rope is not None and config.sliding_window(index) is not None:
            return self.local_rotary
        return self.rotary


class DecoderForCausalLM(nn.Module):
    """The decoder, or with a tensor-parallel `group` the part of it `plan` gives this rank."""

    def __init__(
        self, config: DecoderConfig, plan: ShardPlan | None = None, group: TensorParallelGroup | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.plan = plan or ShardPlan(config)
        self.group = group
        self.model = DecoderModel(config, self.plan, group)
        self.lm_head = Linear(config.hidden_size, self.plan.vocab_rows, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """With tied embeddings the LM head is the embedding matrix (again after the model is moved or allocated)."""
        if not self.config.tie_word_embeddings:
            return
        embedding = self.model.embed_tokens
        if isinstance(embedding, QuantizedEmbedding):
            self.lm_head.quantize((embedding.quantized,))
        else:
            self.lm_head.weight = embedding.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[PagedKV],
        metadata: AttentionMetadata,
        backend: KernelBackend,
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden_size] of the packed tokens after the final norm."""
        hidden, residual = self.model.embed_tokens(input_ids), None
        if self.config.embedding_scale != 1.0:
            # As HF: the scale rounded to the model's dtype first.
            hidden = hidden * torch.tensor(self.config.embedding_scale, dtype=hidden.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, positions, kv_cache, metadata, backend)
        return self.model.norm.add_and_norm(hidden, residual, backend)[0]

    def compute_logits(self, hidden: torch.Tensor, backend: KernelBackend) -> torch.Tensor | None:
        """Logits [rows, vocab_size] (fp32); with tensor parallelism each rank computes its vocabulary rows' and
        rank 0 gathers them (the others get None)."""
        logits = self.lm_head(hidden, backend).float()
        cap = self.config.final_logit_softcap
        logits = logits if cap is None else torch.tanh(logits / cap) * cap
        if self.group is None:
            return logits
        parts = self.group.gather_on_first(logits)
        return None if parts is None else torch.cat(parts, dim=-1)[:, : self.config.vocab_size]
