"""The Triton backend: every KV write and attention call of a step, the layer ops, the mixture-of-experts MLPs and
the GEMMs on group-quantized weights through our kernels (FP8_DYNAMIC layers through `torch._scaled_mm` where the
GPU has float8 tensor cores); dense linear layers through torch's GEMM (cuBLAS)."""

from dataclasses import dataclass

import torch
import triton

from kvserve.kernels import triton_group_quant, triton_layer_ops, triton_lora, triton_moe
from kvserve.kernels.attention_metadata import AttentionMetadata
from kvserve.kernels.backend import AttentionShape, TorchGemm
from kvserve.kernels.fp8_scaled_mm import fp8_scaled_linear, scaled_mm_takes
from kvserve.kernels.group_quant import chunked_group_quantized_linear
from kvserve.kernels.paged_kv import PagedKV
from kvserve.kernels.triton_decode_attention import DecodeWorkspace, paged_decode_attention
from kvserve.kernels.triton_extend_attention import paged_extend_attention
from kvserve.kernels.triton_store_kv import store_kv

# Split-KV launch settings: starting points, not yet measured on a GPU (benchmarks/gpu_check.sh is
# where to tune them). Shorter segments add partial-result traffic and merge work for little gain.
MAX_DECODE_SEGMENTS = 16
MIN_SEGMENT_TOKENS = 256
DECODE_BLOCK_N = 64


def num_decode_segments(num_seqs: int, num_kv_heads: int, max_seq_len: int, target_programs: int) -> int:
    """Segments per sequence so the decode grid has about `target_programs` programs."""
    wanted = triton.cdiv(target_programs, num_seqs * num_kv_heads)
    longest_useful = triton.cdiv(max_seq_len, MIN_SEGMENT_TOKENS)
    return max(1, min(wanted, longest_useful, MAX_DECODE_SEGMENTS))


@dataclass(frozen=True)
class TritonBackend(TorchGemm):
    """Decodes (the leading one-token requests) run the split-KV decode kernel, the rest the
    extend kernel; both write rows of one output, so each row is written exactly once. A sliding
    window and a soft-cap select compiled variants of both kernels (see `attention_options`)."""

    workspace: DecodeWorkspace
    target_programs: int
    float8_tensor_cores: bool  # compute capability 8.9 or more: `torch._scaled_mm` multiplies float8
    name: str = "triton"
    lora_tiled: bool = True

    @classmethod
    def create(cls, shape: AttentionShape, device: torch.device) -> "TritonBackend":
        workspace = DecodeWorkspace.allocate(
            shape.max_num_seqs, shape.num_heads, shape.head_dim, MAX_DECODE_SEGMENTS, device
        )
        # Aim for about two programs per multiprocessor; the interpreter runs programs one by one.
        on_gpu = device.type == "cuda"
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else 1
        float8_tensor_cores = on_gpu and torch.cuda.get_device_capability(device) >= (8, 9)
        return cls(workspace=workspace, target_programs=2 * num_sms, float8_tensor_cores=float8_tensor_cores)

    def group_quantized_linear(self, x, weight, bias) -> torch.Tensor:
        if self.float8_tensor_cores and scaled_mm_takes(x, weight):
            return fp8_scaled_linear(x, weight, bias)
        if triton_group_quant.triton_takes(weight):
            return triton_group_quant.group_quantized_linear(x, weight, bias, self.target_programs)
        return chunked_group_quantized_linear(x, weight, bias)

    def add_lora(self, out, x, stacks, batch) -> torch.Tensor:
        return triton_lora.add_lora(out, x, stacks, batch)

    def store_kv(self, key, value, cache, slot_mapping) -> None:
        store_kv(key, value, cache, slot_mapping)

    def paged_attention(
        self, query: torch.Tensor, cache: PagedKV, metadata: AttentionMetadata, scale: float,
        sliding_window: int | None = None, logit_softcap: float | None = None,
    ) -> torch.Tensor:  # fmt: skip
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        num_decodes = metadata.num_decodes
        if num_decodes:
            # A decode reads at most `sliding_window` positions: its segments split that many.
            max_visible = metadata.max_seq_len if sliding_window is None else min(metadata.max_seq_len, sliding_window)
            segments = num_decode_segments(num_decodes, cache.num_kv_heads, max_visible, self.target_programs)
            paged_decode_attention(
                query[:num_decodes],
                cache,
                metadata.block_tables,
                metadata.seq_lens,
                scale,
                segments,
                self.workspace,
                out[:num_decodes],
                block_n=DECODE_BLOCK_N,
                sliding_window=sliding_window,
                logit_softcap=logit_softcap,
            )
        paged_extend_attention(
            query,
            cache,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            scale,
            first_seq=num_decodes,
            num_seqs=metadata.num_seqs - num_decodes,
            max_query_len=metadata.max_query_len,
            out=out,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
        )
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return triton_layer_ops.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
        return triton_layer_ops.add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return triton_layer_ops.silu_and_mul(x)

    def rotary_embedding(self, positions, query, key, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        return triton_layer_ops.rotary_embedding(positions, query, key, cos, sin)

    def fused_moe(self, hidden, gate_up_weight, down_weight, topk_weights, topk_ids, prepared=None) -> torch.Tensor:
        return triton_moe.fused_moe(hidden, gate_up_weight, down_weight, topk_weights, topk_ids)
