"""The Triton kernels against their torch references at production shapes (the tests use small ones).

Decode and extend attention over bf16 and int8 caches (block 16, 32 query / 8 KV heads, head_dim 64
and 128, contexts up to 32k), the KV store (bf16 and int8, which must be exact: its divisions are
IEEE-rounded, as torch's are), the fused layer ops at Llama-3-8B sizes (hidden 4096, MLP 14336,
head_dim 128), GGUF's block formats through the torch path and compressed-tensors' group layouts through the Triton
GEMM (FP8_DYNAMIC through `torch._scaled_mm`) at Llama-3-8B's MLP shape, and the LoRA GEMMs over mixed adapters at its
q/k/v shape, with their times.
Each line prints the largest difference and the bound it is held to; the script exits 1 if any exceeds it.

    python -m benchmarks.gpu_kernel_check           # CUDA
    python -m benchmarks.gpu_kernel_check --smoke   # small shapes in Triton's interpreter on a CPU
"""

import argparse
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.harness import paged_batch
from kvserve.kernels import (
    AttentionShape,
    PagedKV,
    paged_attention,
    select_backend,
    store_kv,
    torch_layer_ops,
    triton_layer_ops,
)
from kvserve.kernels.triton_store_kv import store_kv as triton_store_kv

ATTENTION_BOUND = 2e-2  # bfloat16 outputs against an fp32 reference (the unit tests' bound)


class Checker:
    def __init__(self) -> None:
        self.failures = 0

    def report(self, name: str, difference: float, bound: float) -> None:
        ok = difference <= bound
        self.failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: max |difference| {difference:.3g} (bound {bound:.3g})", flush=True)

    def ulps(self, name: str, actual: torch.Tensor, expected: torch.Tensor, ulps: float = 1.0) -> None:
        """Largest difference in units of the last place of the expected value (>= 1: at magnitude 1 or more)."""
        unit = torch.finfo(expected.dtype).eps * expected.float().abs().clamp_min(1.0)
        self.report(f"{name} (in ulps)", ((actual.float() - expected.float()).abs() / unit).max().item(), ulps)


def int8_like(cache: torch.Tensor) -> PagedKV:
    data = [torch.randint(-127, 128, cache.shape, dtype=torch.int8, device=cache.device) for _ in range(2)]
    return PagedKV(*data, *(torch.rand(cache.shape[:-1], device=cache.device) / 64 for _ in range(2)))


def check_attention(checker, device, batch, context, query_len, head_dim, smoke) -> None:
    num_heads, num_kv_heads = (8, 2) if smoke else (32, 8)
    key_cache, value_cache, metadata = paged_batch(
        batch, context, query_len, num_kv_heads, head_dim, torch.bfloat16, device
    )
    query = torch.randn(batch * query_len, num_heads, head_dim, dtype=torch.bfloat16, device=device)
    backend = select_backend("triton", device, AttentionShape(batch, num_heads, head_dim))
    scale = head_dim**-0.5
    kind = "decode" if query_len == 1 else f"extend {query_len} new"
    for cache_name, cache in (("bf16", PagedKV(key_cache, value_cache)), ("int8", int8_like(key_cache))):
        actual = backend.paged_attention(query, cache, metadata, scale)
        reference_cache = cache if cache.quantized else PagedKV(cache.key.float(), cache.value.float())
        expected = paged_attention(query.float(), reference_cache, metadata, scale)
        difference = (actual.float() - expected).abs().max().item()
        name = f"{kind}, {cache_name} cache, batch {batch} x context {context}, head_dim {head_dim}"
        checker.report(name, difference, ATTENTION_BOUND)
        del actual, expected
    if device.type == "cuda":
        torch.cuda.empty_cache()


def check_store(checker, device, head_dim) -> None:
    num_tokens, num_kv_heads = 300, 8
    key = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=torch.bfloat16, device=device) * 3
    value = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=torch.bfloat16, device=device)
    slots = torch.randperm(64 * 16, device=device)[:num_tokens]
    for int8 in (False, True):
        caches = []
        for _ in range(2):
            shape = (64, 16, num_kv_heads, head_dim)
            data = [torch.zeros(shape, dtype=torch.int8 if int8 else torch.bfloat16, device=device) for _ in "kv"]
            scales = [torch.zeros(shape[:-1], device=device) for _ in "kv"] if int8 else []
            caches.append(PagedKV(*data, *scales))
        store_kv(key, value, caches[0], slots)
        triton_store_kv(key, value, caches[1], slots)
        tensors = [
            (a, b) for a, b in zip(vars(caches[0]).values(), vars(caches[1]).values(), strict=True) if a is not None
        ]
        difference = max((a.float() - b.float()).abs().max().item() for a, b in tensors)
        if difference:  # how many, per tensor (in PagedKV's field order): a rounding or a bug
            counts = [int((a != b).sum()) for a, b in tensors]
            print(f"     {sum(counts)} of {sum(a.numel() for a, _ in tensors)} stored values differ: {counts}")
        checker.report(f"store, {'int8' if int8 else 'bf16'} cache, head_dim {head_dim}", difference, 0.0)


def check_layer_ops(checker, device, smoke) -> None:
    hidden, intermediate, head_dim, tokens = (64, 96, 16, 5) if smoke else (4096, 14336, 128, 512)
    dtype = torch.bfloat16
    x, residual = (torch.randn(tokens, hidden, dtype=dtype, device=device) for _ in range(2))
    weight = torch.rand(hidden, dtype=dtype, device=device) + 0.5
    # Approximate fp32 1/sqrt, division and exp on the GPU flip a rounding, and the product carries it: 2 ulps; the
    # interpreter's bfloat16 casts truncate: 3 (the arithmetic is spelt out in tests/test_triton_layer_ops.py).
    ulps = 2.0 if device.type == "cuda" else 3.0
    checker.ulps(
        "rms_norm", triton_layer_ops.rms_norm(x, weight, 1e-6), torch_layer_ops.rms_norm(x, weight, 1e-6), ulps
    )
    expected, expected_sum = torch_layer_ops.add_rms_norm(x, residual, weight, 1e-6)
    actual, actual_sum = triton_layer_ops.add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
    checker.ulps("add_rms_norm", actual, expected, ulps)
    checker.ulps("add_rms_norm residual", actual_sum, expected_sum, ulps)
    gate_up = torch.randn(tokens, 2 * intermediate, dtype=dtype, device=device) * 4
    checker.ulps("silu_and_mul", triton_layer_ops.silu_and_mul(gate_up), torch_layer_ops.silu_and_mul(gate_up), ulps)
    num_heads, num_kv_heads = hidden // head_dim, max(1, hidden // head_dim // 4)
    query = torch.randn(tokens, num_heads, head_dim, dtype=dtype, device=device)
    key = torch.randn(tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    positions = torch.randint(0, 32768, (tokens,), device=device)
    angles = torch.outer(
        torch.arange(32768.0, device=device), 1e6 ** -(torch.arange(0, head_dim, 2, device=device) / head_dim)
    )
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    expected_q, expected_k = torch_layer_ops.rotary_embedding(positions, query, key, cos, sin)
    actual_q, actual_k = triton_layer_ops.rotary_embedding(positions, query.clone(), key.clone(), cos, sin)
    # The reference rounds after each product in bfloat16, the kernel once in fp32: 3 ulps of the input's scale.
    bound = 3 * torch.finfo(dtype).eps * query.float().abs().max().item()
    checker.report("rotary query", (actual_q.float() - expected_q.float()).abs().max().item(), bound)
    checker.report("rotary key", (actual_k.float() - expected_k.float()).abs().max().item(), bound)


def check_block_quant(checker, device, smoke) -> None:
    """GGUF's block formats through the torch path (what a GPU runs them on until Triton kernels exist) against the
    CPU reference, each output within 1e-5 of the sum of its products' magnitudes (float32 sums in another order;
    TF32 is off for float32 matmuls by default), and its time per call at 1 and 32 rows."""
    from kvserve.kernels.block_quant import QuantizedWeight, chunked_quantized_linear, dequantize, quantized_linear
    from tests.test_block_quant import random_weight

    out_features, in_features = (300, 512) if smoke else (14336, 4096)
    for name in ("q8_0", "q4_0", "q5_0", "q4_k", "q6_k"):
        weight = random_weight(name, out_features, in_features)
        on_device = QuantizedWeight(weight.format, weight.data.to(device), in_features)
        for rows in (1, 32):
            x = torch.randn(rows, in_features)
            expected = quantized_linear(x, (weight,), None)
            actual = chunked_quantized_linear(x.to(device), (on_device,), None).cpu()
            magnitudes = x.abs() @ dequantize(weight).abs().T
            excess = ((actual - expected).abs() - 1e-5 * magnitudes).max().item()
            checker.report(f"block-quantized {name} linear, {rows} rows (excess over the bound)", max(excess, 0.0), 0.0)
            if device.type == "cuda":
                milliseconds = time_ms(chunked_quantized_linear, x.to(device), (on_device,), None)
                print(f"     {name} {rows} rows [{out_features}, {in_features}]: {milliseconds:.3f} ms per call")


# compressed-tensors' layouts: (label, values, scales' dtype, zero points, group size (None: a scale per channel),
# inputs quantized per token).
GROUP_LAYOUTS = [
    ("W4A16 g128", 4, torch.bfloat16, False, 128, None),
    ("W4A16 g128 asym", 4, torch.bfloat16, True, 128, None),
    ("W8A16 channel", 8, torch.bfloat16, False, None, None),
    ("W8A16 channel f32 scales", 8, torch.float32, False, None, None),
    ("FP8 weights channel", "fp8", torch.bfloat16, False, None, None),
    ("FP8_DYNAMIC channel", "fp8", torch.bfloat16, False, None, "fp8"),
]


def check_group_quant(checker, device, smoke) -> None:
    """compressed-tensors' group layouts through the Triton backend (the Triton GEMM; FP8_DYNAMIC through
    `torch._scaled_mm` where the GPU has float8 tensor cores) on bfloat16 inputs, against the float32 reference:
    within 1e-5 of each output's sum of product magnitudes plus one bfloat16 unit of the output (both outputs are
    rounded to bfloat16); the `_scaled_mm` path within two bfloat16 units of the largest output (it rounds the weights
    differently, kernels/fp8_scaled_mm.py). bfloat16 scales are held to the GPU's bound only on a GPU: the
    interpreter's bfloat16 casts truncate (2**-7). On a GPU, times per call beside the torch path's (widening 512
    rows at a time) and a dense bfloat16 GEMM's."""
    from dataclasses import replace

    from kvserve.kernels.fp8_scaled_mm import scaled_mm_takes
    from kvserve.kernels.group_quant import (
        chunked_group_quantized_linear,
        dequantize,
        group_quantized_linear,
        quantize_activations,
    )
    from kvserve.testing.group_weights import random_group_weight

    out_features, in_features = (96, 256) if smoke else (14336, 4096)
    backend = select_backend("triton", device, AttentionShape(512, 32, 128))
    dense = torch.randn(out_features, in_features, dtype=torch.bfloat16, device=device)
    for label, kind, scale_dtype, zero_points, group_size, activations in GROUP_LAYOUTS:
        weight = random_group_weight(kind, scale_dtype, zero_points, group_size or in_features, *dense.shape)
        weight = replace(weight, activations=activations).to(device)
        magnitudes_weight = dequantize(weight).abs().T
        for rows in (1, 32) if smoke else (1, 32, 512):
            x = torch.randn(rows, in_features, dtype=torch.bfloat16, device=device)
            actual = backend.group_quantized_linear(x, weight, None).float()
            expected = group_quantized_linear(x, weight, None).float()
            scaled_mm = backend.float8_tensor_cores and scaled_mm_takes(x, weight)
            if scaled_mm:
                bound = 2 * torch.finfo(torch.bfloat16).eps * expected.abs().max()
            else:
                relative = 2**-7 if scale_dtype == torch.bfloat16 and device.type != "cuda" else 1e-5
                inputs = x.float() if activations is None else quantize_activations(x.float(), activations)
                output_rounding = expected.abs() * torch.finfo(torch.bfloat16).eps
                bound = relative * (inputs.abs() @ magnitudes_weight) + output_rounding
            excess = ((actual - expected).abs() - bound).max().item()
            path = "_scaled_mm" if scaled_mm else "Triton"
            name = f"group-quantized {label} ({path}), {rows} rows (excess over the bound)"
            checker.report(name, max(excess, 0.0), 0.0)
            if device.type == "cuda":
                ours = time_ms(backend.group_quantized_linear, x, weight, None)
                torch_path = time_ms(chunked_group_quantized_linear, x, weight, None)
                dense_ms = time_ms(torch.nn.functional.linear, x, dense)
                print(f"     {label} {rows} rows [{out_features}, {in_features}]: {path} {ours:.3f} ms, torch path "
                      f"{torch_path:.3f} ms, dense bf16 {dense_ms:.3f} ms per call")  # fmt: skip


def check_lora(checker, device, smoke) -> None:
    """The LoRA GEMMs (Triton shrink/expand) against the torch path on bfloat16 at Llama-3-8B's q/k/v shape, rank 16,
    for a decode batch of 32 tokens over 32 adapters, of 8, and a 2048-token prompt chunk of one: within two bfloat16
    units of the largest output (both round h and the delta to bfloat16). On a GPU, times per call beside the base
    layer's GEMM."""
    import numpy as np

    from kvserve.kernels import torch_lora, triton_lora
    from kvserve.kernels.lora import LoraBatch, LoraStacks

    hidden, parts, rank, slots = (256, ((0, 128), (128, 32), (160, 32)), 16, 8) if smoke else (
        4096, ((0, 4096), (4096, 1024), (5120, 1024)), 16, 32)  # fmt: skip
    out_features = sum(rows for _, rows in parts)
    stacks = LoraStacks(
        torch.randn(slots, len(parts) * rank, hidden, dtype=torch.bfloat16, device=device) / hidden**0.5,
        torch.randn(slots, out_features, rank, dtype=torch.bfloat16, device=device) / rank**0.5, parts,
    )  # fmt: skip
    base = torch.randn(out_features, hidden, dtype=torch.bfloat16, device=device) / hidden**0.5
    for label, token_slots in (
        (f"decode, 32 tokens of {slots} adapters", np.arange(32) % slots),
        ("decode, 32 tokens of 8 adapters", np.arange(32) % 8),
        ("prompt chunk, 2048 tokens of 1 adapter", np.zeros(2048 if not smoke else 64, dtype=np.int64)),
    ):
        x = torch.randn(len(token_slots), hidden, dtype=torch.bfloat16, device=device)
        torch_batch, tiled_batch = (LoraBatch(len(token_slots), slots, device, tiled) for tiled in (False, True))
        for batch in (torch_batch, tiled_batch):
            batch.set(token_slots.astype(np.int64), num_decode_rows=len(token_slots) if "decode" in label else 0)
        out = torch.zeros(len(token_slots), out_features, dtype=torch.bfloat16, device=device)
        expected = torch_lora.add_lora(out.clone(), x, stacks, torch_batch).float()
        actual = triton_lora.add_lora(out.clone(), x, stacks, tiled_batch).float()
        bound = 2 * torch.finfo(torch.bfloat16).eps * expected.abs().max().item()
        checker.report(f"LoRA {label}", (actual - expected).abs().max().item(), bound)
        if device.type == "cuda":
            ours = time_ms(triton_lora.add_lora, out, x, stacks, tiled_batch)
            torch_path = time_ms(torch_lora.add_lora, out, x, stacks, torch_batch)
            base_ms = time_ms(torch.nn.functional.linear, x, base)
            print(f"     LoRA {label}: Triton {ours:.3f} ms, torch path {torch_path:.3f} ms, base GEMM "
                  f"[{out_features}, {hidden}] {base_ms:.3f} ms per call")  # fmt: skip


def time_ms(function, *args) -> float:
    """Median milliseconds of 20 calls of function(*args) after 3, by CUDA events."""
    times = []
    for index in range(23):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        function(*args)
        end.record()
        torch.cuda.synchronize()
        if index >= 3:
            times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="small shapes, to check the script on a CPU")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    checker = Checker()
    if args.smoke:
        cases = [(2, 40, 1, 64), (1, 48, 16, 64)]
    else:
        # (batch, context, new tokens, head_dim): decodes to 32k, a whole prompt, a chunk after a prefix.
        cases = [(8, 1024, 1, d) for d in (64, 128)] + [(4, 8192, 1, 128), (1, 32768, 1, 128), (2, 32768, 1, 64)]
        cases += [(2, 2048, 2048, 128), (1, 8192, 512, 128), (1, 4096, 512, 64)]
    for case in cases:
        check_attention(checker, device, *case, smoke=args.smoke)
    for head_dim in (64, 128):
        check_store(checker, device, head_dim)
    check_layer_ops(checker, device, args.smoke)
    check_block_quant(checker, device, args.smoke)
    check_group_quant(checker, device, args.smoke)
    check_lora(checker, device, args.smoke)
    print(f"{checker.failures} failures")
    sys.exit(1 if checker.failures else 0)


if __name__ == "__main__":
    main()
