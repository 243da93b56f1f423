"""The CPU backend: oneDNN GEMMs on weights packed at load time (linear layers and experts), the C++ kernels (KV
store, decode attention, fused layer ops, block-quantized linear layers), torch SDPA for prompt chunks."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.kernels import onednn, torch_lora, torch_moe, torch_paged_attention
from kvserve.kernels.attention_metadata import AttentionMetadata
from kvserve.kernels.group_quant import GroupQuantizedWeight, chunked_group_quantized_linear, quantize_activations
from kvserve.kernels.paged_kv import PagedKV

# Rows of input up to which a block-quantized linear layer widens its blocks in registers or a register tile; past
# them, widened chunks of the weight and a GEMM (kernels/csrc/cpu_block_quant.cpp), which measured faster from 128
# rows at the Qwen2-0.5B shapes (BENCHMARKS.md, issue 28).
MAX_FUSED_ROWS = 64


@dataclass(frozen=True)
class CpuBackend:
    """Decodes (the leading one-token requests) go to one C++ call for the whole batch; prompt chunks
    are few per step and long, and the torch path hands each to SDPA's flash kernel. Linear layers and experts
    run on oneDNN's packed copies of their weights where this CPU packs their dtype (see kernels/onednn.py)."""

    name: str = "cpu"
    lora_tiled: bool = False

    def prepare_linear(self, weight: torch.Tensor) -> torch.Tensor | None:
        return onednn.pack(weight) if onednn.can_pack(weight) else None

    def linear(self, x, weight, bias, prepared) -> torch.Tensor:
        if prepared is None:
            return F.linear(x, weight, bias)
        return onednn.packed_linear(x, prepared, bias)

    def quantized_linear(self, x, weights, bias) -> torch.Tensor:
        out = torch.empty(x.shape[0], sum(w.out_features for w in weights), dtype=x.dtype)
        first = 0
        for weight in weights:
            torch.ops.kvserve_cpu.block_quant_linear(
                out.narrow(1, first, weight.out_features), x, weight.data, weight.format.code, weight.in_features,
                MAX_FUSED_ROWS,
            )  # fmt: skip
            first += weight.out_features
        return out if bias is None else out.add_(bias)

    def group_quantized_linear(self, x, weight, bias) -> torch.Tensor:
        if not _cpp_takes(weight):
            return chunked_group_quantized_linear(x, weight, bias)
        inputs = x if weight.activations is None else quantize_activations(x.float(), weight.activations)
        out = torch.empty(x.shape[0], weight.out_features, dtype=inputs.dtype)
        torch.ops.kvserve_cpu.group_quant_linear(
            out, inputs, weight.values, weight.num_bits, weight.scales, weight.zero_points, weight.group_size,
            MAX_FUSED_ROWS,
        )  # fmt: skip
        if bias is not None:
            out.add_(bias)
        return out.to(x.dtype)

    def add_lora(self, out, x, stacks, batch) -> torch.Tensor:
        return torch_lora.add_lora(out, x, stacks, batch)

    def prepare_experts(self, gate_up_weight, down_weight) -> torch_moe.OneDnnExperts | None:
        return torch_moe.OneDnnExperts(gate_up_weight, down_weight) if onednn.can_pack(gate_up_weight) else None

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, cache: PagedKV, slot_mapping: torch.Tensor) -> None:
        torch.ops.kvserve_cpu.store_kv(
            key, value, cache.key, cache.value, cache.key_scale, cache.value_scale, slot_mapping
        )

    def paged_attention(
        self, query: torch.Tensor, cache: PagedKV, metadata: AttentionMetadata, scale: float,
        sliding_window: int | None = None, logit_softcap: float | None = None,
    ) -> torch.Tensor:  # fmt: skip
        if sliding_window is not None or logit_softcap is not None:
            # The C++ decode kernel has neither: Gemma's layers take the torch path.
            return torch_paged_attention.paged_attention(query, cache, metadata, scale, sliding_window, logit_softcap)
        out = torch.empty_like(query)
        # Decodes, and the few tokens of a request verifying drafts, through the decode kernel, a query row each.
        rows = metadata.decode_rows
        if rows.num_tokens:
            torch.ops.kvserve_cpu.paged_decode_attention(
                out[: rows.num_tokens], query[: rows.num_tokens], cache.key, cache.value, cache.key_scale,
                cache.value_scale, rows.block_tables, rows.seq_lens, scale,
            )  # fmt: skip
        torch_paged_attention.extend_attention(query, cache, metadata, scale, out, first_seq=rows.num_seqs)
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x  # [tokens, heads, D]: a row per head
        out = torch.empty(rows.shape, dtype=x.dtype)
        torch.ops.kvserve_cpu.rms_norm(out, rows, weight, eps)
        return out.view(x.shape)

    def add_rms_norm(self, x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
        torch.ops.kvserve_cpu.add_rms_norm(x, residual, weight, eps)
        return x, residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
        torch.ops.kvserve_cpu.silu_and_mul(out, x)
        return out

    def rotary_embedding(self, positions, query, key, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        torch.ops.kvserve_cpu.rotary_embedding(positions, query, key, cos, sin)
        return query, key

    def fused_moe(self, hidden, gate_up_weight, down_weight, topk_weights, topk_ids, prepared=None) -> torch.Tensor:
        if prepared is not None:
            return prepared.fused_moe(hidden, topk_weights, topk_ids)
        return torch_moe.fused_moe(hidden, gate_up_weight, down_weight, topk_weights, topk_ids)


def _cpp_takes(weight: GroupQuantizedWeight) -> bool:
    """The C++ kernels' group layouts: float32 or bfloat16 scales, groups of a multiple of 32 (float16 scales and
    other groups take the torch path)."""
    return weight.scales.dtype in (torch.float32, torch.bfloat16) and weight.group_size % 32 == 0
