"""Block-quantized weights: the torch reference dequantizes GGML's block layouts as the `gguf` package (llama.cpp's
own Python reader, an independent implementation) does, and the C++ kernels compute the reference's linear layer."""

import gguf
import numpy as np
import pytest
import torch

from kvserve.kernels.block_quant import (
    FORMATS,
    BlockQuantError,
    QuantizedWeight,
    dequantize,
    padded_rows,
    quantized_linear,
)
from kvserve.kernels.cpu_extension import load_cpu_kernels

GGML_TYPES = {
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
    "q5_0": gguf.GGMLQuantizationType.Q5_0,
    "q4_k": gguf.GGMLQuantizationType.Q4_K,
    "q6_k": gguf.GGMLQuantizationType.Q6_K,
    "f16": gguf.GGMLQuantizationType.F16,
    "bf16": gguf.GGMLQuantizationType.BF16,
    "f32": gguf.GGMLQuantizationType.F32,
}
# Byte offsets of each block's float16 scales: random bytes there could be inf or NaN.
HALF_OFFSETS = {"q8_0": (0,), "q4_0": (0,), "q5_0": (0,), "q4_k": (0, 2), "q6_k": (208,)}


def random_weight(name: str, rows: int, in_features: int, seed: int = 0) -> QuantizedWeight:
    """Random blocks (every bit pattern of the quants and packed scales is valid) with small finite scales."""
    fmt = FORMATS[name]
    generator = torch.Generator().manual_seed(seed)
    if name in ("f32", "f16", "bf16"):
        dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[name]
        values = torch.randn(rows, in_features, generator=generator).to(dtype)
        return QuantizedWeight(fmt, values.view(torch.uint8), in_features)
    data = torch.randint(0, 256, (rows, fmt.row_bytes(in_features)), dtype=torch.uint8, generator=generator)
    blocks = data.view(-1, fmt.block_bytes)
    for offset in HALF_OFFSETS[name]:
        scales = (torch.rand(blocks.shape[0], generator=generator) * 0.02 + 0.001).to(torch.float16)
        blocks[:, offset : offset + 2] = scales.view(torch.uint8).view(-1, 2)
    return QuantizedWeight(fmt, data, in_features)


@pytest.mark.parametrize("name", sorted(GGML_TYPES))
def test_reference_dequantizes_as_gguf_does(name):
    weight = random_weight(name, 6, 512)
    expected = gguf.quants.dequantize(weight.data.numpy(), GGML_TYPES[name])
    np.testing.assert_array_equal(dequantize(weight).numpy(), expected.astype(np.float32))


@pytest.mark.parametrize("name", sorted(GGML_TYPES))
def test_reference_makes_every_tensor_on_the_weights_device(name):
    # On the meta device a tensor made on the CPU cannot meet the weight's (the GPU check found one in q5_0, whose
    # weight was on CUDA): the torch path serves GGUF weights on any device.
    weight = random_weight(name, 6, 512)
    on_meta = padded_rows(QuantizedWeight(weight.format, weight.data.to("meta"), weight.in_features), 8)
    assert dequantize(on_meta).shape == (8, 512)
    assert dequantize(on_meta).device.type == "meta"


def test_shapes_that_do_not_fit_the_blocks_are_refused():
    with pytest.raises(BlockQuantError, match="multiple of 256"):
        QuantizedWeight(FORMATS["q4_k"], torch.zeros(2, 144, dtype=torch.uint8), 300)
    weight = random_weight("q4_k", 2, 512)
    with pytest.raises(BlockQuantError, match="cut through"):
        weight.columns(128, 256)
    assert torch.equal(dequantize(weight.columns(256, 256)), dequantize(weight)[:, 256:])


needs_kernels = pytest.mark.skipif(not load_cpu_kernels(), reason="the C++ CPU kernels could not be built here")


@needs_kernels
@pytest.mark.parametrize("name", sorted(GGML_TYPES))
def test_cpu_dequantize_matches_reference(name):
    weight = random_weight(name, 5, 512, seed=1)
    out = torch.empty(5, 512)
    torch.ops.kvserve_cpu.block_quant_dequantize(out, weight.data, weight.format.code, 512)
    torch.testing.assert_close(out, dequantize(weight), rtol=0, atol=0)


@needs_kernels
@pytest.mark.parametrize("name", sorted(GGML_TYPES))
@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_linear_matches_reference(name, rows, dtype):
    """Both paths (fused for up to 16 rows here, widened chunks and a GEMM past that), into a column slice of a
    wider output as a packed projection's parts are. The sums are float32 in another order than the reference's:
    each differs by at most a few ulps of the sum of its products' magnitudes (bounded here by 1e-5 of it, 168
    float32 ulps); bfloat16 outputs by one bfloat16 ulp besides (2^-7 of the value), where the two sums round apart."""
    weight = random_weight(name, 300, 512, seed=2)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(3)).to(dtype)
    wide = torch.full((rows, 310), float("nan"), dtype=dtype)
    torch.ops.kvserve_cpu.block_quant_linear(wide[:, 5:305], x, weight.data, weight.format.code, 512, 16)
    expected = quantized_linear(x, (weight,), None)
    magnitudes = x.float().abs() @ dequantize(weight).abs().T
    bound = 1e-5 * magnitudes + (expected.float().abs() * 2**-7 if dtype == torch.bfloat16 else 0)
    assert ((wide[:, 5:305].float() - expected.float()).abs() <= bound).all()
    assert wide[:, :5].isnan().all() and wide[:, 305:].isnan().all()
