"""Compiles every Triton kernel to a cubin for a GPU architecture with the installed Triton's real
compiler, on a machine without a GPU: catches what the interpreter lets through (tensor-core shape
and dtype rules, lowering errors) for the inputs the engine runs on CUDA.

    python tests/triton_compile_check.py [--arch 90]      # must run without TRITON_INTERPRET
"""

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvserve.kernels.paged_kv import INT8_MAX
from kvserve.kernels.triton_common import padded
from kvserve.kernels.triton_decode_attention import _decode_segment_kernel, _merge_segments_kernel
from kvserve.kernels.triton_extend_attention import _extend_kernel
from kvserve.kernels.triton_group_quant import BLOCK_N as GROUP_GEMM_BLOCK_N
from kvserve.kernels.triton_group_quant import _group_gemm_kernel
from kvserve.kernels.triton_layer_ops import (
    ROTARY_HEADS_TILE,
    SILU_BLOCK,
    _rms_norm_kernel,
    _rotary_kernel,
    _silu_and_mul_kernel,
)
from kvserve.kernels.triton_moe import (
    BLOCK_K,
    BLOCK_N,
    COMBINE_BLOCK,
    MAX_BLOCK_M,
    _combine_kernel,
    _expert_matmul_kernel,
)
from kvserve.kernels.triton_store_kv import _store_kv_kernel

INT32_POINTERS = ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr", "sorted_rows_ptr", "block_experts_ptr")
# The most shared memory one program may use on sm_90 (227 KiB): a kernel over it compiles but fails to launch.
SM90_MAX_SHARED_BYTES = 232448
# Qwen3-0.6B (GQA 2, head_dim 128) and GQA 4 with head_dim 64.
MODEL_SHAPES = [(16, 8, 128), (16, 4, 64)]
DTYPES = [("bf16", False), ("fp16", False), ("fp32", False), ("bf16", True)]
# The attention kernels' per-layer options (kernels/triton_common.py `attention_options`): none (every model but
# Gemma, and Gemma 3's global layers), Gemma 2's local (4096-token window) and global layers, both soft-capped at
# 50, and Gemma 3's local layers (1024-token window); the int8 cache with both options. For Gemma's head_dim 256
# (Gemma 2 2B, Gemma 3 4B: 8 heads, 4 KV heads).
NO_OPTIONS = {"SLIDING_WINDOW": 0, "LOGIT_SOFTCAP": 0.0}
GEMMA_SHAPE = (8, 4, 256)
GEMMA_VARIANTS = [
    ("bf16", False, NO_OPTIONS),
    ("bf16", False, {"SLIDING_WINDOW": 4096, "LOGIT_SOFTCAP": 50.0}),
    ("bf16", False, {"SLIDING_WINDOW": 0, "LOGIT_SOFTCAP": 50.0}),
    ("bf16", False, {"SLIDING_WINDOW": 1024, "LOGIT_SOFTCAP": 0.0}),
    ("bf16", True, {"SLIDING_WINDOW": 4096, "LOGIT_SOFTCAP": 50.0}),
]


def signature(kernel, data_type: str, int8_cache: bool, constexprs: dict) -> dict[str, str]:
    types = {}
    for name in kernel.arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name in ("slot_mapping_ptr", "positions_ptr"):
            types[name] = "*i64"
        elif name in ("cos_ptr", "sin_ptr"):
            types[name] = "*fp32"
        elif name in INT32_POINTERS:
            types[name] = "*i32"
        elif name.startswith("partial_") or name.endswith("_scale_ptr") or name == "topk_weights_ptr":
            types[name] = "*fp32"
        elif name in ("key_cache_ptr", "value_cache_ptr"):
            types[name] = "*i8" if int8_cache else f"*{data_type}"
        elif name.endswith("_ptr"):
            types[name] = f"*{data_type}"
        elif name in ("scale", "eps"):
            types[name] = "fp32"
        else:
            types[name] = "i32"  # strides and counts
    return types


def attention_configs(
    data_type: str, int8_cache: bool, num_heads: int, num_kv_heads: int, head_dim: int, options: dict,
    block_size: int = 16,
):  # fmt: skip
    """The decode and extend kernels' constexprs as the wrappers pass them on CUDA (see kernels/triton_common.py
    for the dot settings)."""
    group = num_heads // num_kv_heads
    common = {
        "HEAD_DIM": head_dim, "HEAD_DIM_PAD": padded(head_dim), "BLOCK_SIZE": block_size,
        "DOT_FP32": data_type == "fp32", "DOT_PRECISION": "ieee" if data_type == "fp32" else "tf32",
        "QUANTIZED": int8_cache, **options,
    }  # fmt: skip
    for single_segment in (False, True):  # split (then merged), or the whole context writing the output itself
        yield _decode_segment_kernel, {
            "GROUP_SIZE": group, "GROUP_PAD": padded(group), "BLOCK_N": 64, "SINGLE_SEGMENT": single_segment, **common
        }  # fmt: skip
    yield _extend_kernel, {"GROUP_SIZE": group, "BLOCK_M": 64, "BLOCK_N": 64, **common}


def kernel_configs(
    data_type: str, int8_cache: bool, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int = 16
):
    """Every kernel's constexprs as the wrappers pass them on CUDA, attention without per-layer options."""
    yield _store_kv_kernel, {
        "NUM_KV_HEADS": num_kv_heads, "HEAD_DIM": head_dim, "KV_HEADS_PAD": triton.next_power_of_2(num_kv_heads),
        "HEAD_DIM_PAD": padded(head_dim, minimum=1), "BLOCK_SIZE": block_size, "QUANTIZED": int8_cache,
        "INT8_LIMIT": INT8_MAX,
    }  # fmt: skip
    yield from attention_configs(data_type, int8_cache, num_heads, num_kv_heads, head_dim, NO_OPTIONS, block_size)
    yield _merge_segments_kernel, {"SEGMENTS_PAD": 16, "HEAD_DIM": head_dim, "HEAD_DIM_PAD": padded(head_dim)}
    hidden = num_heads * head_dim
    for size in (hidden, head_dim):  # the layer norms, and Qwen3's per-head q/k norm
        for add_residual in (False, True):
            yield _rms_norm_kernel, {
                "SIZE": size, "SIZE_PAD": triton.next_power_of_2(size), "ADD_RESIDUAL": add_residual
            }  # fmt: skip
    yield _silu_and_mul_kernel, {"BLOCK": SILU_BLOCK}
    yield _rotary_kernel, {
        "HALF": head_dim // 2, "HALF_PAD": triton.next_power_of_2(head_dim // 2),
        "HEADS_TILE": min(ROTARY_HEADS_TILE, triton.next_power_of_2(num_heads)),
    }  # fmt: skip


def moe_configs(data_type: str, top_k: int = 2):
    """The fused-MoE kernels' constexprs: gate/up (gated, one input row per top-k slot) and down, at the smallest
    and largest rows per block, then the weighted sum over top-k."""
    dots = {"DOT_FP32": data_type == "fp32", "DOT_PRECISION": "ieee" if data_type == "fp32" else "tf32"}
    for block_m in (16, MAX_BLOCK_M):
        for gated, inputs_per_row in ((True, top_k), (False, 1)):
            yield _expert_matmul_kernel, {
                "INPUTS_PER_ROW": inputs_per_row, "GATED": gated, "BLOCK_M": block_m, "BLOCK_N": BLOCK_N,
                "BLOCK_K": BLOCK_K, **dots,
            }  # fmt: skip
    yield _combine_kernel, {"TOP_K": top_k, "BLOCK": COMBINE_BLOCK}


# The group GEMM's variants (compressed-tensors' weights): (values, bits, zero points, scales, rows per tile). Every
# value layout on tensor cores (bfloat16 scales and inputs) at a decode tile writing split-K partial sums; float32
# scales (or float32 inputs, quantized per token) through float32 products; prefill tiles writing the output with its
# bias (the compiler takes 4-6 s for a float32 one: one of those).
GROUP_GEMM_VARIANTS = [
    *((values, bits, zero_points, "bf16", 16) for values, bits, zero_points in
      [("u8", 4, False), ("u8", 4, True), ("i8", 8, False), ("i8", 8, True), ("fp8e4nv", 8, False)]),
    ("u8", 4, True, "fp32", 16), ("fp8e4nv", 8, False, "fp32", 16),
    ("u8", 4, True, "bf16", 64), ("i8", 8, False, "bf16", 64), ("i8", 8, False, "fp32", 64),
]  # fmt: skip


def group_gemm_configs():
    """The group GEMM's constexprs and argument types as the wrapper launches them on CUDA. Yields (label,
    constexprs, types)."""
    for values, num_bits, zero_points, scales, tile_m in GROUP_GEMM_VARIANTS:
        partial = tile_m == 16
        types = {
            "x_ptr": "*bf16" if scales == "bf16" else "*fp32", "values_ptr": f"*{values}", "scales_ptr": f"*{scales}",
            "zero_points_ptr": "*i8", "bias_ptr": "*bf16", "out_ptr": "*fp32" if partial else "*bf16",
        }  # fmt: skip
        constexprs = {
            "NUM_BITS": num_bits, "HAS_ZERO_POINTS": zero_points, "HAS_BIAS": not partial,
            "ROUND_TO_SCALES": scales != "fp32", "PARTIAL": partial, "GROUP_SIZE": 128, "BLOCK_M": tile_m,
            "BLOCK_N": GROUP_GEMM_BLOCK_N, "BLOCK_K": 128, "DOT_FP32": scales == "fp32",
        }  # fmt: skip
        label = f"{values} values{' with zero points' if zero_points else ''}, {scales} scales, {tile_m} rows"
        yield label, constexprs, types


def compile_for(
    target: GPUTarget, kernel, data_type: str, int8_cache: bool, constexprs: dict, types: dict | None = None
) -> int:
    """Compiles one kernel variant to a cubin (`types`: argument types that differ from `signature`'s); returns
    the shared memory one program uses."""
    source = ASTSource(
        fn=kernel,
        signature={**signature(kernel, data_type, int8_cache, constexprs), **(types or {})},
        constexprs={(kernel.arg_names.index(name),): value for name, value in constexprs.items()},
    )
    compiled = triton.compile(source, target=target)
    assert compiled.asm["cubin"], kernel.__name__
    if target.arch == 90:
        assert compiled.metadata.shared <= SM90_MAX_SHARED_BYTES, (kernel.__name__, constexprs)
    return compiled.metadata.shared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 for H100/H200")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the interpreter replaces the compiler")
    target = GPUTarget("cuda", args.arch, 32)
    variants = [
        (shape, data_type, int8_cache, "", config)
        for shape in MODEL_SHAPES
        for data_type, int8_cache in DTYPES
        for config in kernel_configs(data_type, int8_cache, *shape)
    ]
    variants += [
        (GEMMA_SHAPE, data_type, int8_cache, f", window {opts['SLIDING_WINDOW']}, cap {opts['LOGIT_SOFTCAP']}", config)
        for data_type, int8_cache, opts in GEMMA_VARIANTS
        for config in attention_configs(data_type, int8_cache, *GEMMA_SHAPE, opts)
    ]
    variants += [
        ((), data_type, False, ", fused MoE", config)
        for data_type, _ in DTYPES[:3]
        for config in moe_configs(data_type)
    ]
    for shape, data_type, int8_cache, label, (kernel, constexprs) in variants:
        start_s = time.perf_counter()
        shared_bytes = compile_for(target, kernel, data_type, int8_cache, constexprs)
        elapsed_s = time.perf_counter() - start_s
        cache = "int8" if int8_cache else data_type
        print(
            f"sm_{args.arch} {data_type}, {cache} cache, heads {shape}{label}: {kernel.__name__} "
            f"{elapsed_s:.1f} s, {shared_bytes} B shared"
        )
    for label, constexprs, types in group_gemm_configs():
        start_s = time.perf_counter()
        shared_bytes = compile_for(target, _group_gemm_kernel, "fp32", False, constexprs, types)
        elapsed_s = time.perf_counter() - start_s
        print(f"sm_{args.arch} group GEMM, {label}: {elapsed_s:.1f} s, {shared_bytes} B shared")
    print(f"all kernels compile with triton {triton.__version__}")


if __name__ == "__main__":
    main()
