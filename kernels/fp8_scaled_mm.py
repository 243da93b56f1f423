"""Float8 GEMM through `torch._scaled_mm` (cuBLASLt's float8 tensor cores, on GPUs of compute capability 8.9 and
up) for compressed-tensors' FP8_DYNAMIC layers: float8 e4m3 weights with a scale per output channel, inputs
quantized to float8 per token.

The input is quantized by `group_quant.quantized_activations`, as the reference quantizes it; the
GEMM then multiplies the float8 operands and applies both scales to the float32 sums, where the reference
multiplies the dequantized operands. Two roundings differ: the reference rounds each weight times its scale to
the scales' dtype, and this path rounds the output to bfloat16 before the bias is added. So the results are
within a few bfloat16 units of the reference, not equal to it (vLLM's float8 path, too, multiplies float8
operands and scales the sums).
"""

import torch

from kvserve.kernels.group_quant import GroupQuantizedWeight, quantized_activations


def scaled_mm_takes(x: torch.Tensor, weight: GroupQuantizedWeight) -> bool:
    """What this path computes: float8 weights per channel (or per tensor, stored per channel) with float8 inputs,
    bfloat16 activations (row-wise scales give bfloat16 outputs only) and dimensions of a multiple of 16."""
    return (
        weight.values.dtype == torch.float8_e4m3fn
        and weight.activations == "fp8"
        and weight.group_size == weight.in_features
        and x.dtype == torch.bfloat16
        and weight.in_features % 16 == 0
        and weight.out_features % 16 == 0
    )


def fp8_scaled_linear(x: torch.Tensor, weight: GroupQuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] (bfloat16) times the float8 weight, scaled per token and per channel, plus bias."""
    quantized, input_scales = quantized_activations(x.float(), "fp8")  # float8 [rows, in], float32 [rows, 1]
    weight_scales = weight.scales.float().reshape(1, -1)  # [1, out]
    out = torch._scaled_mm(
        quantized, weight.values.t(), scale_a=input_scales, scale_b=weight_scales, out_dtype=torch.bfloat16
    )
    return out if bias is None else out.add_(bias)
