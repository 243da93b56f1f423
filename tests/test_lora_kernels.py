"""The LoRA GEMMs over a batch mixing adapters (and base-model tokens): the torch path and the Triton kernels (in the
interpreter on a CPU) against each token's adapter applied alone."""

import numpy as np
import pytest
import torch

from kvserve.kernels import torch_lora
from kvserve.kernels.lora import TILE_ROWS, LoraBatch, LoraStacks

# The Triton kernels run on the GPU where there is one (the interpreter otherwise); the torch path on the CPU.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
IN_FEATURES = 48
PART_ROWS = ((0, 32), (32, 8), (40, 8))  # q/k/v-like parts of a packed layer
MAX_RANK = 8


def _stacks(num_slots: int, ranks: list[int], generator: torch.Generator) -> LoraStacks:
    """Random adapters of the given ranks, zero-padded to MAX_RANK as the engine pads them."""
    out_features = sum(rows for _, rows in PART_ROWS)
    a = torch.zeros(num_slots, len(PART_ROWS) * MAX_RANK, IN_FEATURES)
    b = torch.zeros(num_slots, out_features, MAX_RANK)
    for slot, rank in enumerate(ranks):
        for part, (first, rows) in enumerate(PART_ROWS):
            a[slot, part * MAX_RANK : part * MAX_RANK + rank] = torch.randn(rank, IN_FEATURES, generator=generator)
            b[slot, first : first + rows, :rank] = torch.randn(rows, rank, generator=generator)
    return LoraStacks(a, b, PART_ROWS)


def _expected(out: torch.Tensor, x: torch.Tensor, stacks: LoraStacks, token_slots: np.ndarray) -> torch.Tensor:
    expected = out.clone()
    for token, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        for part, (first, rows) in enumerate(stacks.part_rows):
            a = stacks.a[slot, part * MAX_RANK : (part + 1) * MAX_RANK]
            expected[token, first : first + rows] += (x[token] @ a.T) @ stacks.b[slot, first : first + rows].T
    return expected


SLOT_PATTERNS = {
    "one_adapter_all_tokens": [0] * 5,
    "base_only": [-1] * 4,
    "consecutive_runs": [1] * 3 + [-1] * 2 + [0] * 20,  # one run longer than a tile
    "interleaved": [0, 2, -1, 0, 1, 2, 2, -1, 0, 1, 0],
    "many_tiles": [i % 3 - 1 for i in range(3 * TILE_ROWS + 5)],
}


@pytest.mark.parametrize("pattern", sorted(SLOT_PATTERNS))
@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("decodes", ["no_decodes", "some_decodes", "all_decodes"])
def test_mixed_adapters_match_each_token_alone(pattern, path, decodes):
    """Leading decode rows go through the torch path's dense pass over the slots (when they use most of them)."""
    generator = torch.Generator().manual_seed(0)
    token_slots = np.array(SLOT_PATTERNS[pattern], dtype=np.int64)
    stacks = _stacks(3, [8, 4, 1], generator)
    x = torch.randn(len(token_slots), IN_FEATURES, generator=generator)
    out = torch.randn(len(token_slots), stacks.b.shape[1], generator=generator)
    expected = _expected(out, x, stacks, token_slots)
    device = DEVICE if path == "triton" else torch.device("cpu")
    batch = LoraBatch(max_num_tokens=64, max_loras=3, device=device, tiled=path == "triton")
    num_decode_rows = {"no_decodes": 0, "some_decodes": len(token_slots) // 2, "all_decodes": len(token_slots)}[decodes]
    batch.set(token_slots, num_decode_rows=num_decode_rows)
    decode_slots = token_slots[:num_decode_rows]
    uses_dense_rows = path == "torch" and (decode_slots >= 0).any()  # these patterns use most slots they reach
    assert (batch.dense is not None) == uses_dense_rows
    stacks = LoraStacks(stacks.a.to(device), stacks.b.to(device), stacks.part_rows)
    out, x = out.to(device), x.to(device)
    if path == "torch":
        result = torch_lora.add_lora(out, x, stacks, batch)
    else:
        from kvserve.kernels import triton_lora

        result = triton_lora.add_lora(out, x, stacks, batch)
    assert result is out
    torch.testing.assert_close(result.cpu(), expected, rtol=1e-5, atol=1e-4)


def test_a_graph_sized_batch_launches_empty_tiles_that_change_nothing():
    """A decode graph launches its capture's tile count; tiles past the step's own have no rows."""
    from kvserve.kernels import triton_lora

    generator = torch.Generator().manual_seed(1)
    stacks = _stacks(2, [8, 8], generator)
    token_slots = np.array([1, -1, 0], dtype=np.int64)
    x = torch.randn(3, IN_FEATURES, generator=generator)
    expected = _expected(torch.zeros(3, stacks.b.shape[1]), x, stacks, token_slots)
    out = torch.zeros(3, stacks.b.shape[1], device=DEVICE)
    batch = LoraBatch(max_num_tokens=8, max_loras=2, device=DEVICE, tiled=True)
    batch.set(np.array([0] * 8, dtype=np.int64))  # a previous step's tiles must not linger
    batch.set(token_slots, fixed_num_tiles=batch.tiles_for(8))
    assert batch.num_tiles == batch.tiles_for(8) > 2
    triton_lora.add_lora(out, x.to(DEVICE), LoraStacks(stacks.a.to(DEVICE), stacks.b.to(DEVICE), PART_ROWS), batch)
    out = out.cpu()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    assert out[1].abs().max() == 0  # the base-model token


def test_groups_are_slices_for_consecutive_tokens_and_indices_otherwise():
    batch = LoraBatch(max_num_tokens=16, max_loras=2, device=torch.device("cpu"), tiled=False)
    batch.set(np.array([-1, 1, 1, 0, 1], dtype=np.int64))
    (slot_0, rows_0), (slot_1, rows_1) = batch.groups
    assert (slot_0, rows_0) == (0, slice(3, 4))
    assert slot_1 == 1 and rows_1.tolist() == [1, 2, 4]


def test_decodes_of_few_of_the_slots_they_reach_take_the_groups():
    """One decode in slot 7 and one in slot 0: a dense pass would read six unused slots' weights."""
    batch = LoraBatch(max_num_tokens=16, max_loras=8, device=torch.device("cpu"), tiled=False)
    batch.set(np.array([7, 0, 3, 3], dtype=np.int64), num_decode_rows=2)
    assert batch.dense is None and [slot for slot, _ in batch.groups] == [0, 3, 7]
    batch.set(np.array([1, 0, -1, 3, 3], dtype=np.int64), num_decode_rows=3)
    assert batch.dense.num_slots == 2 and batch.dense.mask.tolist() == [[0, 1], [1, 0], [0, 0]]
    assert batch.groups == [(3, slice(3, 5))]
