"""What a LoRA GEMM needs: a linear layer's adapter weights, one slot per resident adapter (`LoraStacks`), and which
slot each token of the step uses (`LoraBatch`).

A layer's output gains, for each token t whose request runs adapter s, `(x_t @ A_s^T) @ B_s^T` (the adapter's
scaling folded into B when it is loaded). Tokens are grouped by adapter so each group is two GEMMs (the "shrink" to
the rank and the "expand" back), for all rows of one adapter at once: segment GEMMs, never one adapter per step and
never merged weights. A packed layer (q/k/v, gate/up) stacks its parts' A matrices, so the shrink is one GEMM, and
expands each part into its own output rows.

Ranks below the stacks' `max_rank` are padded with zero rows of A and zero columns of B: their products add exact
zeros, so a rank-8 and a rank-16 adapter share one batch.
"""

from dataclasses import dataclass

import numpy as np
import torch

# Tokens of one adapter per tile of the Triton kernels (`LoraBatch.tiles`).
TILE_ROWS = 16


@dataclass(frozen=True)
class LoraStacks:
    """One linear layer's adapter weights: slot s holds the adapter resident in slot s (zeros when empty)."""

    a: torch.Tensor  # [slots, num_parts * max_rank, in_features]
    b: torch.Tensor  # [slots, out_features, max_rank], scaling folded in
    part_rows: tuple[tuple[int, int], ...]  # (first output row, rows) of each part; part p reads h[:, p*R:(p+1)*R]

    @property
    def max_rank(self) -> int:
        return self.b.shape[2]


def _host_buffer(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, pin_memory=device.type == "cuda")


class LoraBatch:
    """Which adapter slot each token of the step uses, rewritten every step into buffers allocated once (a captured
    decode graph reads them, as it reads the other step inputs).

    `groups` (the torch path's, read on the host): each slot used this step with its tokens, as a slice when they are
    consecutive (one request, or requests of one adapter side by side) and an index tensor otherwise. `tiles` (the
    Triton kernels'): rows (first index into `token_order`, rows, slot) of at most TILE_ROWS tokens of one adapter;
    `token_order` lists the adapter tokens grouped by slot. Base-model tokens are in neither.
    """

    def __init__(self, max_num_tokens: int, max_loras: int, device: torch.device) -> None:
        self.max_loras = max_loras
        self.max_tiles = self.tiles_for(max_num_tokens)
        self.host_token_order = _host_buffer(max_num_tokens, torch.int64, device)
        self.host_tiles = _host_buffer((self.max_tiles, 3), torch.int32, device)
        on_host = device.type == "cpu"
        self.token_order = self.host_token_order if on_host else torch.zeros_like(self.host_token_order, device=device)
        self.tiles = self.host_tiles if on_host else torch.zeros_like(self.host_tiles, device=device)
        self.groups: list[tuple[int, slice | torch.Tensor]] = []
        self.num_tiles = 0

    def tiles_for(self, num_tokens: int) -> int:
        """The most tiles a step of `num_tokens` tokens can need: each adapter's run wastes at most one partial tile."""
        return -(-num_tokens // TILE_ROWS) + min(self.max_loras, num_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.groups and not self.num_tiles

    def set(self, token_slots: np.ndarray, fixed_num_tiles: int | None = None) -> None:
        """Take this step's slot per token (-1: the base model). `fixed_num_tiles`: launch that many tiles (a decode
        graph's, captured with it; the tiles past the step's are empty) instead of the step's own count."""
        order = np.argsort(token_slots, kind="stable")
        order = order[token_slots[order] >= 0]
        slots = token_slots[order]
        boundaries = np.flatnonzero(np.diff(slots)) + 1
        starts = np.concatenate(([0], boundaries)) if len(order) else np.zeros(0, dtype=np.int64)
        ends = np.concatenate((boundaries, [len(order)])) if len(order) else np.zeros(0, dtype=np.int64)
        self.host_token_order.numpy()[: len(order)] = order
        groups, tiles = [], []
        for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
            slot, first, last = int(slots[start]), int(order[start]), int(order[end - 1])
            consecutive = last - first + 1 == end - start
            groups.append((slot, slice(first, last + 1) if consecutive else self.token_order[start:end]))
            tiles += [(first_row, min(TILE_ROWS, end - first_row), slot) for first_row in range(start, end, TILE_ROWS)]
        num_tiles = len(tiles) if fixed_num_tiles is None else fixed_num_tiles
        host_tiles = self.host_tiles.numpy()
        host_tiles[: len(tiles)] = tiles if tiles else np.zeros((0, 3))
        host_tiles[len(tiles) : num_tiles] = 0  # empty tiles: no rows
        self.groups, self.num_tiles = groups, num_tiles
        if self.token_order.data_ptr() != self.host_token_order.data_ptr():
            self.token_order[: len(order)].copy_(self.host_token_order[: len(order)], non_blocking=True)
            self.tiles[:num_tiles].copy_(self.host_tiles[:num_tiles], non_blocking=True)
