"""Group-quantized (compressed-tensors) linear layers on a CPU at the Qwen2-0.5B layer shapes: kvserve's C++ kernels
(kernels/csrc/cpu_block_quant.cpp) and its torch path (512 rows widened at a time, then a float32 GEMM; float16
scales take it) against the dense float32 path (oneDNN on a packed weight, what an unquantized model
runs), and, for scale, torch's own int8 weight kernel (`torch._weight_int8pack_mm`, a scale per channel) on float32
and on bfloat16 inputs.

    .venv/bin/python -m benchmarks.group_quant_gemm [--rows 1,8,32] [--schemes int8-channel,int4-g128,...]

Times are medians of 20 calls after 3 warm-up calls, in microseconds, for one layer's projections together
(q/k/v, o, gate/up, down), with torch's default threads.
"""

import argparse

import torch

from benchmarks.block_quant_gemm import LAYER, time_us
from kvserve.kernels import onednn
from kvserve.kernels.cpu_backend import CpuBackend
from kvserve.kernels.cpu_extension import load_cpu_kernels
from kvserve.kernels.group_quant import GroupQuantizedWeight, chunked_group_quantized_linear
from kvserve.testing.group_weights import random_group_weight

# scheme: (values: bits or "fp8", group size (None: the row), zero points)
SCHEMES = {
    "int8-channel": (8, None, False),
    "int4-g128": (4, 128, False),
    "int4-g128-asym": (4, 128, True),
    "fp8-channel": ("fp8", None, False),
}


def scheme_weight(scheme: str, rows: int, in_features: int) -> GroupQuantizedWeight:
    """Random values and small scales (as the tests make them) in `scheme`."""
    kind, group_size, zero_points = SCHEMES[scheme]
    return random_group_weight(kind, torch.float32, zero_points, group_size or in_features, rows, in_features)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    args = parser.parse_args()
    assert load_cpu_kernels(), "the C++ kernels could not be built"
    cpu = CpuBackend()
    dense = {name: onednn.pack(torch.randn(n, k) * 0.05) for name, (k, n) in LAYER.items()}
    int8 = {name: scheme_weight("int8-channel", n, k) for name, (k, n) in LAYER.items()}

    def layer_us(call, dtype=torch.float32) -> float:
        return sum(time_us(lambda x, s=shape: call(x, s), torch.randn(rows, k, dtype=dtype))
                   for shape, (k, _) in LAYER.items())  # fmt: skip

    print(f"threads {torch.get_num_threads()}; us per layer (qkv + o + gate_up + down)")
    for rows in [int(r) for r in args.rows.split(",")]:
        dense_us = layer_us(lambda x, s: onednn.packed_linear(x, dense[s]))
        int8pack_us = layer_us(lambda x, s: torch._weight_int8pack_mm(x, int8[s].values, int8[s].scales.view(-1)))
        int8pack_bf16_us = layer_us(
            lambda x, s: torch._weight_int8pack_mm(x, int8[s].values, int8[s].scales.view(-1).bfloat16()),
            torch.bfloat16,
        )
        print(f"rows {rows}: dense float32 {dense_us:.0f}; torch._weight_int8pack_mm float32 inputs {int8pack_us:.0f}, "
              f"bfloat16 inputs {int8pack_bf16_us:.0f}")  # fmt: skip
        for scheme in args.schemes.split(","):
            weights = {name: scheme_weight(scheme, n, k) for name, (k, n) in LAYER.items()}
            torch_us = layer_us(lambda x, s, w=weights: chunked_group_quantized_linear(x, w[s], None))
            kvserve_us = layer_us(lambda x, s, w=weights: cpu.group_quantized_linear(x, w[s], None))
            print(f"  {scheme:16} kvserve {kvserve_us:8.0f} ({kvserve_us / dense_us:.2f}x dense); torch path "
                  f"{torch_us:8.0f} ({torch_us / dense_us:.1f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
