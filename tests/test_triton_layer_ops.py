"""The Triton layer ops equal their torch references (in Triton's interpreter on a CPU, on the GPU when
there is one): RMSNorm of rows and of each head of a strided view, residual add + RMSNorm in place,
SiLU-and-mul, rotary embeddings in place on strided query and key views."""

import pytest
import torch

from kvserve.kernels import torch_layer_ops
from kvserve.kernels.triton_layer_ops import add_rms_norm, rms_norm, rotary_embedding, silu_and_mul

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _random(*shape, dtype, seed, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype).to(DEVICE)


# Units in the last place allowed for 16-bit results (relative to the expected value). Both sides round
# the normalised value (or the activation) to 16 bits and then the product by the weight (or `up`), but
# on a GPU Triton computes 1/sqrt, division and exp with approximate fp32 instructions (within 2 fp32
# ulps, where torch rounds correctly): a value within that of a 16-bit rounding boundary rounds the other
# way, 1 ulp off, and the product carries that ulp into its own rounding: at most 2. Triton's interpreter
# truncates float32 to bfloat16 where torch rounds to nearest, once per rounding: 3.
ULPS = {torch.float16: 2 if DEVICE.type == "cuda" else 1, torch.bfloat16: 2 if DEVICE.type == "cuda" else 3}


def _check(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual.cpu(), expected.cpu(), atol=1e-5, rtol=1e-5)
        return
    ulp = torch.finfo(expected.dtype).eps * expected.float().abs().clamp_min(1.0)
    assert ((actual.float() - expected.float()).abs().cpu() <= ULPS[expected.dtype] * ulp.cpu()).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_rows_and_residual_add_in_place(dtype):
    x, residual = _random(7, 48, dtype=dtype, seed=0), _random(7, 48, dtype=dtype, seed=1)
    weight = _random(48, dtype=dtype, seed=2)
    _check(rms_norm(x, weight, 1e-6), torch_layer_ops.rms_norm(x, weight, 1e-6))
    expected_norm, expected_sum = torch_layer_ops.add_rms_norm(x, residual, weight, 1e-6)
    x_copy, residual_copy = x.clone(), residual.clone()
    norm, summed = add_rms_norm(x_copy, residual_copy, weight, 1e-6)
    assert norm.data_ptr() == x_copy.data_ptr() and summed.data_ptr() == residual_copy.data_ptr()
    _check(norm, expected_norm)
    _check(summed, expected_sum)


def test_rms_norm_of_each_head_of_a_strided_view():
    packed = _random(5, 6 * 24, dtype=torch.float32, seed=3)
    query = packed[:, : 4 * 24].view(5, 4, 24)  # non-power-of-two head size too
    weight = _random(24, dtype=torch.float32, seed=4)
    _check(rms_norm(query, weight, 1e-6), torch_layer_ops.rms_norm(query, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    packed = _random(6, 2 * 40, dtype=dtype, seed=5, scale=6.0)
    _check(silu_and_mul(packed), torch_layer_ops.silu_and_mul(packed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embedding_in_place_on_strided_views(dtype):
    packed = _random(5, (4 + 2 + 2) * 16, dtype=dtype, seed=6)
    query, key = packed[:, :64].view(5, 4, 16), packed[:, 64:96].view(5, 2, 16)
    positions = torch.tensor([0, 3, 9, 2, 40], device=DEVICE)
    angles = torch.outer(torch.arange(64.0), 1.0 / 500 ** (torch.arange(0, 16, 2) / 16))
    cos, sin = (f(torch.cat([angles, angles], -1)).to(DEVICE) for f in (torch.cos, torch.sin))
    expected_query, expected_key = torch_layer_ops.rotary_embedding(positions, query, key, cos, sin)
    rotated_query, rotated_key = rotary_embedding(positions, query, key, cos, sin)
    assert rotated_query.data_ptr() == query.data_ptr()
    # bfloat16: the reference rounds after each product, the kernel once (and the interpreter truncates)
    tolerance = 1e-5 if dtype == torch.float32 else 3 * torch.finfo(dtype).eps * packed.float().abs().max().item()
    for actual, expected in ((rotated_query, expected_query), (rotated_key, expected_key)):
        torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=tolerance, rtol=0)
    assert packed[:, 96:].equal(_random(5, 128, dtype=dtype, seed=6)[:, 96:])  # the values untouched
