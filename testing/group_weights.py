"""Random group-quantized weights (kernels/group_quant.py's layouts) for the kernels' tests and benchmarks, made
without the compressed-tensors package (which the GPU machine's image lacks)."""

import torch

from kvserve.kernels.group_quant import GroupQuantizedWeight


def random_group_weight(
    kind, scale_dtype=torch.float32, zero_points: bool = False, group_size: int = 32, rows: int = 40, columns: int = 256
) -> GroupQuantizedWeight:
    """`kind`: 8 or 4 (bits of integer values) or "fp8" (every float8 e4m3fn byte but NaN's, in turn); small scales."""
    generator = torch.Generator().manual_seed(group_size + zero_points)
    num_bits = 4 if kind == 4 else 8
    if kind == "fp8":
        finite = torch.arange(256, dtype=torch.uint8)
        finite = finite[(finite & 0x7F) != 0x7F]
        values = finite[torch.arange(rows * columns) % len(finite)].reshape(rows, columns).view(torch.float8_e4m3fn)
    elif kind == 8:
        values = torch.randint(-128, 128, (rows, columns), dtype=torch.int8, generator=generator)
    else:
        values = torch.randint(0, 256, (rows, columns // 2), dtype=torch.uint8, generator=generator)
    scales = (torch.rand(rows, columns // group_size, generator=generator) / 50).to(scale_dtype)
    zeros = torch.randint(-8, 8, scales.shape, dtype=torch.int8, generator=generator) if zero_points else None
    return GroupQuantizedWeight(values, num_bits, scales, zeros, group_size, columns)
