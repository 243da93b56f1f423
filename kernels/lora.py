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
    b: torch.Tensor  # [slots, out_features, max_rank], scaling folded in (the engine stores it [out, slots, rank])
    part_rows: tuple[tuple[int, int], ...]  # (first output row, rows) of each part; part p reads h[:, p*R:(p+1)*R]

    @property
    def max_rank(self) -> int:
        return self.b.shape[2]


def _host_buffer(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, pin_memory=device.type == "cuda")


@dataclass(frozen=True)
class DenseRows:
    """The torch path's way with a step's leading decode rows: one shrink over the first `num_slots` slots at once and,
    per part, one expand over them, with each row's other slots zeroed by `mask` [rows, num_slots] (a one-hot of its
    slot; all zero for a base-model row). Two GEMMs a layer instead of two per adapter: a decode batch of 32 requests
    of 32 adapters costs 2, not 64, and reads each slot's weights once."""

    num_rows: int
    num_slots: int
    mask: torch.Tensor


class LoraBatch:
    """Which adapter slot each token of the step uses, rewritten every step into buffers allocated once (a captured
    decode graph reads them, as it reads the other step inputs).

    A batch is made for one reader (`tiled`), and `set` builds that reader's view only. The torch path's, read on the
    host: `dense` for the leading decode rows when they use most of the slots up to the highest they use, and
    `groups` for the other tokens: each slot with its tokens, as a slice when they are consecutive (a prompt chunk)
    and an index tensor otherwise. The Triton kernels' (`tiled`): `tiles`, rows (first index into `token_order`,
    rows, slot) of at most TILE_ROWS tokens of one adapter, `token_order` listing every adapter token grouped by slot.
    Base-model tokens are in none of them but the dense rows (with a zero mask).
    """

    def __init__(self, max_num_tokens: int, max_loras: int, device: torch.device, tiled: bool) -> None:
        self.max_loras = max_loras
        self.device = device
        self.tiled = tiled
        self.max_tiles = self.tiles_for(max_num_tokens)
        self.host_token_order = _host_buffer(max_num_tokens, torch.int64, device)
        self.host_tiles = _host_buffer((self.max_tiles, 3), torch.int32, device)
        on_host = device.type == "cpu"
        self.token_order = self.host_token_order if on_host else torch.zeros_like(self.host_token_order, device=device)
        self.tiles = self.host_tiles if on_host else torch.zeros_like(self.host_tiles, device=device)
        self.dense: DenseRows | None = None
        self.groups: list[tuple[int, slice | torch.Tensor]] = []
        self.num_tiles = 0

    def tiles_for(self, num_tokens: int) -> int:
        """The most tiles a step of `num_tokens` tokens can need: each adapter's run wastes at most one partial tile."""
        return -(-num_tokens // TILE_ROWS) + min(self.max_loras, num_tokens)

    @property
    def is_empty(self) -> bool:
        return self.dense is None and not self.groups and not self.num_tiles

    def set(self, token_slots: np.ndarray, fixed_num_tiles: int | None = None, num_decode_rows: int = 0) -> None:
        """Take this step's slot per token (-1: the base model), whose first `num_decode_rows` are decodes (the torch
        path's dense rows). `fixed_num_tiles` (tiled): launch that many tiles (a decode graph's, captured with it; the
        tiles past the step's are empty) instead of the step's own count."""
        if self.tiled:
            self._set_tiles(token_slots, fixed_num_tiles)
            return
        self.dense = self._dense_rows(token_slots[:num_decode_rows])
        grouped = token_slots.copy()
        if self.dense is not None:
            grouped[: self.dense.num_rows] = -1
        grouped_order, grouped_runs = _sorted_runs(grouped)
        self.groups = [(slot, self._rows(grouped_order[start:end])) for slot, start, end in grouped_runs]

    def _set_tiles(self, token_slots: np.ndarray, fixed_num_tiles: int | None) -> None:
        order, runs = _sorted_runs(token_slots)
        tiles = [
            (first, min(TILE_ROWS, end - first), slot) for slot, start, end in runs
            for first in range(start, end, TILE_ROWS)
        ]  # fmt: skip
        self.host_token_order.numpy()[: len(order)] = order
        num_tiles = len(tiles) if fixed_num_tiles is None else fixed_num_tiles
        host_tiles = self.host_tiles.numpy()
        host_tiles[: len(tiles)] = tiles if tiles else np.zeros((0, 3))
        host_tiles[len(tiles) : num_tiles] = 0  # empty tiles: no rows
        self.num_tiles = num_tiles
        if self.token_order.data_ptr() != self.host_token_order.data_ptr():
            self.token_order[: len(order)].copy_(self.host_token_order[: len(order)], non_blocking=True)
            self.tiles[:num_tiles].copy_(self.host_tiles[:num_tiles], non_blocking=True)

    def _dense_rows(self, decode_slots: np.ndarray) -> DenseRows | None:
        """Dense rows when the decodes use at least half the slots up to the highest they use (else reading the
        unused slots' weights would cost more than the groups' extra calls save)."""
        used = np.unique(decode_slots[decode_slots >= 0])
        if not len(used) or 2 * len(used) < used[-1] + 1:
            return None
        num_slots = int(used[-1]) + 1
        mask = np.zeros((len(decode_slots), num_slots), dtype=np.float32)
        adapter_rows = np.flatnonzero(decode_slots >= 0)
        mask[adapter_rows, decode_slots[adapter_rows]] = 1.0
        return DenseRows(len(decode_slots), num_slots, torch.from_numpy(mask).to(self.device))

    def _rows(self, rows: np.ndarray) -> slice | torch.Tensor:
        first, last = int(rows[0]), int(rows[-1])
        if last - first + 1 == len(rows):
            return slice(first, last + 1)
        return torch.from_numpy(rows).to(self.device)


def _sorted_runs(token_slots: np.ndarray) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """The adapter tokens' rows sorted by slot (stable: rows in order within a slot), and each slot's run in it as
    (slot, start, end)."""
    order = np.argsort(token_slots, kind="stable")
    order = order[token_slots[order] >= 0]
    slots = token_slots[order]
    starts = np.flatnonzero(np.diff(slots, prepend=-1)).tolist()
    ends = [*starts[1:], len(order)] if starts else []
    return order, [(int(slots[start]), start, end) for start, end in zip(starts, ends, strict=True)]
