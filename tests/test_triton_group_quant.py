"""The Triton GEMM on group-quantized weights (compressed-tensors' W8A16, W4A16, float8) equals the reference, and
the Triton backend runs compressed-tensors checkpoints with HF's tokens; the float8 `torch._scaled_mm` path stays
within bfloat16 rounding of the reference.

Without a GPU the kernel runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1). Each output is held to
1e-5 of the sum of its products' magnitudes (float32 sums in another order), except with bfloat16 scales in the
interpreter: its float32 -> bfloat16 casts truncate where a GPU rounds to nearest, so a widened weight may be one
bfloat16 unit (2**-7 relative) below the reference's; the bound is then that unit. benchmarks/gpu_kernel_check.py
holds bfloat16 scales to 1e-5 on a GPU.
"""

import os
from dataclasses import replace

import pytest
import torch

from kvserve.engine import LLM
from kvserve.kernels import AttentionShape, select_backend
from kvserve.kernels.fp8_scaled_mm import fp8_scaled_linear, scaled_mm_takes
from kvserve.kernels.group_quant import dequantize, group_quantized_linear, quantize_activations
from kvserve.kernels.triton_group_quant import group_quantized_linear as triton_group_quantized_linear
from kvserve.kernels.triton_group_quant import split_k, triton_takes
from kvserve.testing.group_weights import random_group_weight
from tests.test_compressed_tensors import CT_DIR, hf_reference_of, scheduling_paths, tolerance
from tests.test_parity import assert_matches_hf

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def bound_for(scale_dtype: torch.dtype) -> float:
    return 2**-7 if scale_dtype == torch.bfloat16 and INTERPRETED else 1e-5


def excess(actual: torch.Tensor, expected: torch.Tensor, x: torch.Tensor, weight, relative: float) -> float:
    """The largest difference beyond `relative` times the sum of its products' magnitudes (0 when within)."""
    magnitudes = x.float().abs() @ dequantize(weight).abs().T
    return ((actual.float() - expected.float()).abs() - relative * magnitudes).clamp(min=0).max().item()


@pytest.mark.parametrize(("kind", "zero_points"), [(8, False), (8, True), (4, False), (4, True), ("fp8", False)])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_size", [32, 256])
def test_the_kernel_widens_groups_as_the_reference_at_every_split(kind, zero_points, scale_dtype, group_size):
    """One row (a decode), a few rows over 4 ranges of features, and more rows than a tile over 2, with a bias, on
    a weight whose rows are a view into a larger one (as a tensor-parallel rank's share is)."""
    whole = random_group_weight(kind, scale_dtype, zero_points, group_size, rows=56)
    weight = whole.rows(8, 40)
    generator = torch.Generator().manual_seed(1)
    for rows, splits in ((1, None), (3, 4), (20, 2)):
        x = torch.randn(rows, weight.in_features, generator=generator)
        bias = torch.randn(weight.out_features, generator=generator)
        actual = triton_group_quantized_linear(x.to(DEVICE), weight.to(DEVICE), bias.to(DEVICE), splits=splits).cpu()
        expected = group_quantized_linear(x, weight, bias)
        assert excess(actual, expected, x, weight, bound_for(scale_dtype)) == 0, (rows, splits)


def test_sixteen_bit_inputs_come_back_in_their_dtype_and_quantized_inputs_are_quantized():
    weight = random_group_weight(4, torch.float32, True, 64)
    x = torch.randn(5, weight.in_features, dtype=torch.bfloat16)
    actual = triton_group_quantized_linear(x.to(DEVICE), weight.to(DEVICE), None).cpu()
    assert actual.dtype == torch.bfloat16
    expected = group_quantized_linear(x, weight, None)
    assert (actual.float() - expected.float()).abs().max() <= 2 * torch.finfo(torch.bfloat16).eps * expected.abs().max()
    for activations in ("int8", "fp8"):
        with_inputs = replace(random_group_weight(8, torch.float32, False, 256), activations=activations)
        x = torch.randn(4, 256)
        actual = triton_group_quantized_linear(x.to(DEVICE), with_inputs.to(DEVICE), None).cpu()
        expected = group_quantized_linear(x, with_inputs, None)
        assert excess(actual, expected, quantize_activations(x, activations), with_inputs, 1e-5) == 0
        assert not torch.allclose(actual, x @ dequantize(with_inputs).T, atol=1e-3)  # the inputs were quantized


def test_decode_sizes_split_the_features_and_large_batches_do_not():
    # A 4096-wide layer's 64 column tiles at one row: split to fill 264 programs (two per H100/H200 multiprocessor).
    assert split_k(1, 4096, 4096, 128, target_programs=264) == 4
    assert split_k(1, 896, 4864, 32, target_programs=264) == 16  # at most MAX_SPLIT_K
    assert split_k(512, 4096, 4096, 128, target_programs=264) == 1
    assert split_k(1, 64, 64, 64, target_programs=264) == 1  # one tile of features cannot be split


def test_the_triton_backend_takes_groups_of_16_and_sends_others_to_the_torch_path():
    backend = select_backend("triton", DEVICE, AttentionShape(4, 8, 16))
    assert triton_takes(random_group_weight(8, group_size=32))
    assert not triton_takes(random_group_weight(8, group_size=8))
    x = torch.randn(2, 256)
    for group_size in (8, 32):
        weight = random_group_weight(8, torch.float32, False, group_size)
        actual = backend.group_quantized_linear(x.to(DEVICE), weight.to(DEVICE), None).cpu()
        assert excess(actual, group_quantized_linear(x, weight, None), x, weight, 1e-5) == 0
    assert backend.float8_tensor_cores == (DEVICE.type == "cuda" and torch.cuda.get_device_capability() >= (8, 9))


def test_float8_scaled_mm_is_within_bfloat16_rounding_of_the_reference():
    """`torch._scaled_mm` (on a CPU too) on FP8_DYNAMIC's layout: the output rounded to bfloat16 once more, and
    the weights not rounded to their scales' dtype, so within two bfloat16 units of the largest output."""
    weight = replace(random_group_weight("fp8", torch.bfloat16, False, 256, rows=48), activations="fp8")
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    bias = torch.randn(48, dtype=torch.bfloat16)
    assert scaled_mm_takes(x, weight)
    actual = fp8_scaled_linear(x.to(DEVICE), weight.to(DEVICE), bias.to(DEVICE)).cpu()
    expected = group_quantized_linear(x, weight, bias)
    bound = 2 * torch.finfo(torch.bfloat16).eps * expected.float().abs().max()
    assert (actual.float() - expected.float()).abs().max() <= bound
    assert not scaled_mm_takes(x.float(), weight)  # row-wise scales give bfloat16 outputs only
    assert not scaled_mm_takes(x, replace(weight, activations=None))  # weight-only float8: the Triton kernel
    assert not scaled_mm_takes(x, random_group_weight("fp8", torch.bfloat16, False, 32))  # groups, not channels


def test_triton_backend_gives_hf_tokens_on_int4_groups_with_zero_points():
    """The most involved layout (packed nibbles, zero points, groups), all prompts in one batch."""
    assert_triton_backend_gives_hf_tokens("llama-w4a16-asym", "one_batch")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-w4a16-asym", "qwen2-w8a16", "qwen3-fp8-dynamic"])
def test_triton_backend_gives_hf_tokens_beside_prompt_chunks_and_after_preemption(name):
    """4-bit groups with zero points, 8-bit groups, float8 channels with float8 inputs (float32 scales: exact in
    the interpreter too). About 40 s each in the interpreter: `make test-slow`."""
    assert_triton_backend_gives_hf_tokens(name, "chunked_preempting")


def assert_triton_backend_gives_hf_tokens(name: str, path: str) -> None:
    checkpoint = CT_DIR / name
    with LLM(str(checkpoint), attention_backend="triton", **scheduling_paths()[path]) as llm:
        assert llm.engine.core.runner.worker.backend.name == "triton"
        assert_matches_hf(llm, hf_reference_of(checkpoint), path, tolerance(checkpoint))
