"""Mixture-of-experts MLPs: the torch path equals the per-expert loop and HF's experts module, the Triton
kernel (in Triton's interpreter on a CPU, on the GPU when there is one) equals the torch path, and every
backend runs it. Routings leave some experts without tokens, whose weights are NaN: no path may read them.
"""

import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from kvserve.kernels import AttentionShape, TorchBackend, onednn
from kvserve.kernels.cpu_backend import CpuBackend
from kvserve.kernels.torch_moe import OneDnnExperts, fused_moe
from kvserve.kernels.triton_backend import TritonBackend
from kvserve.kernels.triton_moe import align_by_expert
from kvserve.kernels.triton_moe import fused_moe as triton_fused_moe
from kvserve.testing.moe_reference import moe_reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _random(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _routing(num_tokens: int, num_experts: int, top_k: int, idle_experts: tuple[int, ...], seed: int):
    """Each token's top-k distinct experts among the non-idle ones and their renormalised fp32 weights."""
    logits = _random(num_tokens, num_experts, seed=seed, scale=2.0)
    logits[:, list(idle_experts)] = float("-inf")
    weights, expert_ids = logits.softmax(dim=-1).topk(top_k, dim=-1)
    return (weights / weights.sum(dim=-1, keepdim=True)).to(DEVICE), expert_ids.to(DEVICE)


def _moe_inputs(num_tokens, num_experts, top_k, hidden_size, intermediate_size, dtype, idle_experts=(1,), seed=0):
    """hidden, gate_up_weight, down_weight, topk_weights, topk_ids; idle experts' weights are NaN."""
    gate_up = _random(num_experts, 2 * intermediate_size, hidden_size, seed=seed + 1, scale=hidden_size**-0.5)
    down = _random(num_experts, hidden_size, intermediate_size, seed=seed + 2, scale=intermediate_size**-0.5)
    gate_up[list(idle_experts)] = float("nan")
    down[list(idle_experts)] = float("nan")
    hidden = _random(num_tokens, hidden_size, seed=seed)
    weights, expert_ids = _routing(num_tokens, num_experts, top_k, idle_experts, seed=seed + 3)
    return (*(t.to(dtype).to(DEVICE) for t in (hidden, gate_up, down)), weights, expert_ids)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, ulps: float = 0) -> None:
    """fp32: 1e-5; 16-bit: `ulps` units in the last place of the largest output (roundings of intermediates
    spread through the down projection, so a per-element bound would be too tight near zero)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.isfinite(actual).all()
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
        return
    tolerance = ulps * torch.finfo(expected.dtype).eps * expected.float().abs().max().clamp_min(1.0).item()
    torch.testing.assert_close(actual.float(), expected.float(), atol=tolerance, rtol=0)


# (num_tokens, num_experts, top_k, idle experts): one-token decodes, top-1 and top-2, several idle experts
ROUTINGS = [(1, 4, 1, (0, 2)), (1, 8, 2, (1,)), (6, 4, 2, (3,)), (17, 8, 1, (0, 5, 7)), (33, 8, 2, (1, 6))]


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "idle_experts"), ROUTINGS)
@pytest.mark.parametrize(("dtype", "ulps"), [(torch.float32, 0), (torch.bfloat16, 1)], ids=["fp32", "bf16"])
def test_torch_path_equals_the_per_expert_loop(num_tokens, num_experts, top_k, idle_experts, dtype, ulps):
    inputs = _moe_inputs(num_tokens, num_experts, top_k, 64, 48, dtype, idle_experts)
    _assert_close(fused_moe(*inputs), moe_reference(*inputs), ulps)


def _hf_experts(implementation: str, gate_up: torch.Tensor, down: torch.Tensor) -> Qwen3MoeExperts:
    num_experts, double_intermediate, hidden_size = gate_up.shape
    config = Qwen3MoeConfig(
        hidden_size=hidden_size, moe_intermediate_size=double_intermediate // 2, num_experts=num_experts
    )
    config._experts_implementation = implementation
    experts = Qwen3MoeExperts(config).to(gate_up.dtype)
    experts.load_state_dict({"gate_up_proj": gate_up, "down_proj": down})
    return experts


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
def test_torch_path_equals_hf_experts_in_fp32(implementation):
    hidden, gate_up, down, weights, expert_ids = _moe_inputs(21, 8, 2, 64, 48, torch.float32, idle_experts=())
    with torch.no_grad():
        expected = _hf_experts(implementation, gate_up.cpu(), down.cpu())(hidden.cpu(), expert_ids.cpu(), weights.cpu())
    _assert_close(fused_moe(hidden, gate_up, down, weights, expert_ids).cpu(), expected)


def test_torch_path_gives_hf_default_experts_bit_for_bit_in_bf16_on_the_cpu():
    """HF's default path sums the top-k products in fp32 and rounds once, as `fused_moe` does; summing in
    bf16 (HF's eager loop) would differ in the last bit."""
    hidden, gate_up, down, weights, expert_ids = (
        t.cpu() for t in _moe_inputs(40, 8, 2, 64, 48, torch.bfloat16, idle_experts=())
    )
    with torch.no_grad():
        expected = _hf_experts("grouped_mm", gate_up, down)(hidden, expert_ids, weights)
    assert fused_moe(hidden, gate_up, down, weights, expert_ids).equal(expected)


def test_align_by_expert_puts_each_expert_in_whole_blocks():
    _, expert_ids = _routing(37, 8, 2, idle_experts=(2, 3), seed=4)
    num_rows, block_m = expert_ids.numel(), 16
    blocks = align_by_expert(expert_ids, 8, block_m)
    rows = blocks.sorted_rows.view(blocks.num_blocks, block_m).long().cpu()
    flat_ids = expert_ids.flatten().cpu()
    real = rows < num_rows
    assert rows[real].sort().values.equal(torch.arange(num_rows))  # every assignment exactly once
    block_experts = blocks.block_experts.long().cpu()
    used = block_experts < 8
    assert (flat_ids[rows.clamp(max=num_rows - 1)] == block_experts[:, None])[real].all()  # one expert per block
    assert (block_experts[used].diff() >= 0).all() and not real[~used].any()  # blocks past the runs are empty
    padding_per_expert = torch.bincount(block_experts[used], minlength=8) * block_m - torch.bincount(
        flat_ids, minlength=8
    )
    assert ((padding_per_expert >= 0) & (padding_per_expert < block_m)).all()  # each run padded to whole blocks


# (num_tokens, num_experts, top_k, hidden, intermediate, idle experts): non-power-of-two sizes for the masks;
# 17 tokens over 2 experts span several blocks per expert.
TRITON_SHAPES = [
    (1, 4, 1, 32, 32, (0, 2)),
    (1, 8, 2, 64, 64, (1,)),
    (5, 4, 2, 48, 64, (3,)),
    (17, 8, 2, 64, 48, (0, 2, 3, 4, 5, 7)),
    (17, 8, 1, 32, 48, (6,)),
]


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "hidden_size", "intermediate", "idle"), TRITON_SHAPES)
def test_triton_kernel_equals_the_torch_path(num_tokens, num_experts, top_k, hidden_size, intermediate, idle):
    inputs = _moe_inputs(num_tokens, num_experts, top_k, hidden_size, intermediate, torch.float32, idle, seed=5)
    _assert_close(triton_fused_moe(*inputs), fused_moe(*inputs))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_kernel_in_16_bit(dtype):
    """Up to four units: the interpreter truncates fp32 to bfloat16 where torch rounds to nearest, at each of
    the five roundings (gate, up, activation, its product with up, the expert output)."""
    inputs = _moe_inputs(9, 8, 2, 64, 48, dtype, idle_experts=(4,), seed=6)
    _assert_close(triton_fused_moe(*inputs), fused_moe(*inputs), ulps=4)


def test_no_tokens_give_an_empty_output():
    inputs = _moe_inputs(0, 4, 2, 32, 32, torch.float32)
    for path in (fused_moe, triton_fused_moe):
        assert path(*inputs).shape == (0, 32)


@pytest.mark.parametrize(
    "backend",
    [TorchBackend(), CpuBackend(), TritonBackend.create(AttentionShape(4, 2, 16), DEVICE)],
    ids=lambda backend: backend.name,
)
def test_every_backend_runs_the_experts(backend):
    if backend.name == "cpu" and DEVICE.type != "cpu":
        pytest.skip("the CPU backend runs on CPU tensors")
    inputs = _moe_inputs(3, 4, 2, 32, 32, torch.float32)
    _assert_close(backend.fused_moe(*inputs), moe_reference(*inputs))


@pytest.mark.parametrize(("dtype", "ulps"), [(torch.float32, 0), (torch.bfloat16, 2)])
def test_experts_packed_for_onednn_equal_the_torch_path(dtype, ulps):
    if not onednn.cpu_packs(dtype):  # bfloat16 needs AVX-512 or AVX-NE-CONVERT; an AVX2 machine keeps plain weights
        pytest.skip(f"this CPU's oneDNN does not pack {dtype}")
    hidden, gate_up, down, weights, expert_ids = _moe_inputs(9, 8, 2, 32, 48, dtype, idle_experts=(1, 5))
    packed = OneDnnExperts(gate_up.cpu(), down.cpu())
    expected = fused_moe(hidden.cpu(), gate_up.cpu(), down.cpu(), weights.cpu(), expert_ids.cpu())
    _assert_close(packed.fused_moe(hidden.cpu(), weights.cpu(), expert_ids.cpu()), expected, ulps)
