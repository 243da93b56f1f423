"""Block-quantized linear layers on a CPU at the Qwen2-0.5B layer shapes: kvserve's C++ kernels (fused one-pass
kernel and widened chunks + GEMM) against the dense float32 path (oneDNN on a packed weight, what an unquantized
model runs), per format and input rows.

    .venv/bin/python -m benchmarks.block_quant_gemm [--rows 1,4,8,16,32,64,256] [--formats q8_0,q4_k,...]

Times are medians of 20 calls after 3 warm-up calls, in microseconds, for one layer's projections together
(q/k/v, o, gate/up, down) and for the LM head, with torch's default threads. Rows of 896 take q4_k's and q6_k's
substitutes in llama-quantize (q5_0, q8_0), as a Q4_K_M file of that model does.
"""

import argparse

import torch

from benchmarks.harness import median_ms
from kvserve.kernels import onednn
from kvserve.kernels.block_quant import FORMATS, QuantizedWeight
from kvserve.kernels.cpu_extension import load_cpu_kernels

HIDDEN, INTERMEDIATE, VOCAB = 896, 4864, 151936
LAYER = {
    "qkv": (HIDDEN, 1152),
    "o": (HIDDEN, HIDDEN),
    "gate_up": (HIDDEN, 2 * INTERMEDIATE),
    "down": (INTERMEDIATE, HIDDEN),
}


# llama-quantize's substitutes where rows are not a multiple of a K-quant's 256 (896 here: all but down's).
FALLBACKS = {"q4_k": "q5_0", "q6_k": "q8_0"}


def random_quantized(name: str, rows: int, in_features: int) -> QuantizedWeight:
    """Random blocks with small finite scales (as tests/test_block_quant.py makes them), in llama-quantize's
    substitute format where the rows do not fit `name`'s blocks."""
    from tests.test_block_quant import random_weight

    if in_features % FORMATS[name].block_size:
        name = FALLBACKS[name]
    return random_weight(name, rows, in_features)


def time_us(fn, x) -> float:
    return median_ms(fn, x, repeats=20, warmup=3) * 1e3


def quantized_call(weight: QuantizedWeight, max_fused_rows: int):
    def call(x):
        out = torch.empty(x.shape[0], weight.out_features)
        torch.ops.kvserve_cpu.block_quant_linear(
            out, x, weight.data, weight.format.code, weight.in_features, max_fused_rows
        )
        return out

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,8,16,32,64,256")
    parser.add_argument("--formats", default="q8_0,q4_0,q5_0,q4_k,q6_k,f16")
    parser.add_argument("--lm-head", action="store_true", help="also the 151936-row LM head (slow to set up)")
    args = parser.parse_args()
    assert load_cpu_kernels(), "the C++ kernels could not be built"
    rows_list = [int(r) for r in args.rows.split(",")]
    shapes = dict(LAYER, **({"lm_head": (HIDDEN, VOCAB)} if args.lm_head else {}))
    dense = {name: onednn.pack(torch.randn(n, k) * 0.05) for name, (k, n) in shapes.items()}
    print(f"threads {torch.get_num_threads()}; us per call (layer = qkv + o + gate_up + down)")
    print(f"{'format':8}{'rows':>6}{'dense f32':>12}{'fused':>12}{'chunked':>12}{'fused/dense':>13}")
    for name in args.formats.split(","):
        weights = {shape: random_quantized(name, n, k) for shape, (k, n) in shapes.items()}
        for rows in rows_list:
            xs = {shape: torch.randn(rows, k) for shape, (k, _) in shapes.items()}
            groups = [("layer", [s for s in LAYER])] + ([("lm_head", ["lm_head"])] if args.lm_head else [])
            for label, members in groups:
                dense_us = sum(time_us(lambda x, w=dense[s]: onednn.packed_linear(x, w), xs[s]) for s in members)
                fused_us = sum(time_us(quantized_call(weights[s], 1 << 30), xs[s]) for s in members)
                chunked_us = sum(time_us(quantized_call(weights[s], 0), xs[s]) for s in members)
                ratio = fused_us / dense_us
                print(f"{name:8}{rows:6d}{dense_us:12.0f}{fused_us:12.0f}{chunked_us:12.0f}{ratio:13.2f}  {label}")


if __name__ == "__main__":
    main()
