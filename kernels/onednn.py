"""oneDNN's GEMM on packed weights, the CPU path of linear layers and experts: each weight is reordered once, at load
time, into oneDNN's blocked layout, so no call pays a reorder (see engine/models/layers.py for why and the figures).

Whether a CPU packs a dtype is asked of oneDNN itself, once per dtype: bfloat16 needs AVX-512 (BW, VL, DQ) or
AVX-NE-CONVERT, and on a CPU with neither (AVX2 only) the reorder raises. There the layer keeps its plain weight.
"""

import functools

import torch

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# The batch size oneDNN chooses the packed layout for; any batch runs on it. Decode batches are this order (for
# experts, rows per expert: 4 to 256 made no difference here at 8 to 1024 tokens).
PACKING_BATCH_HINT = 64
_HAS_PACKING_OPS = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@functools.cache
def cpu_packs(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN packs weights of `dtype` (tried on a small one)."""
    if not _HAS_PACKING_OPS or dtype not in PACKABLE_DTYPES:
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), PACKING_BATCH_HINT)
    except RuntimeError:
        return False
    return True


def can_pack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and cpu_packs(weight.dtype)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] in oneDNN's blocked layout (a copy), for `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKING_BATCH_HINT)


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` on the weight `pack` returned."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")
