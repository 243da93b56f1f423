"""Block-quantized weights: the engine's own form of a quantized linear layer's weight, in the block layouts of
GGML (those GGUF files store, kept byte for byte), with the torch reference that dequantizes them and the reference
quantized linear layer the C++ kernels are tested against.

A weight [out_features, in_features] is stored row by row; each row is a run of blocks along `in_features`, each
block `block_size` values in `block_bytes` bytes:

- q8_0: 32 values: a float16 scale d, then 32 int8 q; w = d * q.
- q4_0: 32 values: d, then 16 bytes whose low nibbles are values 0-15 and high nibbles 16-31; w = d * (q - 8).
- q5_0: 32 values: d, 4 bytes holding bit 4 of value i in bit i, 16 bytes of low nibbles as q4_0's;
  w = d * (q - 16). (llama-quantize writes it for q4_k's tensors whose rows are not a multiple of 256.)
- q4_k: 256 values in 8 sub-blocks of 32: float16 d and dmin, 12 bytes packing a 6-bit scale and a 6-bit min per
  sub-block, 128 bytes of nibbles (bytes 32j..32j+31: sub-block 2j in the low nibbles, 2j+1 in the high);
  w = d * scale * q - dmin * min.
- q6_k: 256 values in 16 sub-blocks of 16: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 int8
  scales, float16 d; w = d * scale * (q - 32).
- f32, f16, bf16: one value a "block" (kept at half the bytes of float32, widened where they are used).

Weights stay in these bytes in memory; kernels widen a block at a time into registers, never the whole weight.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class BlockFormat:
    name: str
    code: int  # the C++ kernels' number for it
    block_size: int
    block_bytes: int

    def row_bytes(self, in_features: int) -> int:
        return in_features // self.block_size * self.block_bytes


FORMATS = {
    format.name: format
    for format in (
        BlockFormat("q8_0", 0, 32, 34),
        BlockFormat("q4_0", 1, 32, 18),
        BlockFormat("q4_k", 2, 256, 144),
        BlockFormat("q6_k", 3, 256, 210),
        BlockFormat("f16", 4, 1, 2),
        BlockFormat("bf16", 5, 1, 2),
        BlockFormat("q5_0", 6, 32, 22),
        BlockFormat("f32", 7, 1, 4),
    )
}


class BlockQuantError(ValueError):
    """A weight's shape does not fit its format's blocks (or a slice of it cuts through a block)."""


@dataclass(eq=False)
class QuantizedWeight:
    """A weight [out_features, in_features] in `format`: `data` uint8 [out_features, row_bytes]."""

    format: BlockFormat
    data: torch.Tensor
    in_features: int

    def __post_init__(self) -> None:
        if self.in_features % self.format.block_size:
            raise BlockQuantError(
                f"{self.format.name} needs rows of a multiple of {self.format.block_size} values, "
                f"got {self.in_features}"
            )
        expected = self.format.row_bytes(self.in_features)
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.data.shape[1] != expected:
            raise BlockQuantError(
                f"{self.format.name} data for rows of {self.in_features} values is uint8 [rows, {expected}], "
                f"got {self.data.dtype} {list(self.data.shape)}"
            )

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, start: int, length: int) -> "QuantizedWeight":
        return QuantizedWeight(self.format, self.data[start : start + length], self.in_features)

    def columns(self, start: int, length: int) -> "QuantizedWeight":
        """Input features [start, start + length): whole blocks only."""
        size = self.format.block_size
        if start % size or length % size:
            raise BlockQuantError(
                f"{self.format.name} blocks hold {size} values: columns {start}..{start + length} cut through one"
            )
        first, count = start // size * self.format.block_bytes, length // size * self.format.block_bytes
        return QuantizedWeight(self.format, self.data[:, first : first + count].contiguous(), length)


def padded_rows(weight: QuantizedWeight, rows: int) -> QuantizedWeight:
    """The weight with zero rows after its own up to `rows` (all-zero bytes are zero values in every format)."""
    padding = weight.data.new_zeros(rows - weight.out_features, weight.data.shape[1])
    return QuantizedWeight(weight.format, torch.cat([weight.data, padding]), weight.in_features)


def concat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """One weight of all rows, in order (the parts of a packed projection that share a format)."""
    first = weights[0]
    assert all(w.format == first.format and w.in_features == first.in_features for w in weights)
    return QuantizedWeight(first.format, torch.cat([w.data for w in weights]), first.in_features)


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """The weight as float32 [out_features, in_features] (the reference; kernels never make this copy)."""
    blocks = weight.data.reshape(-1, weight.format.block_bytes)
    values = _DEQUANTIZERS[weight.format.name](blocks)
    return values.reshape(weight.out_features, weight.in_features)


def quantized_linear(x: torch.Tensor, weights: tuple[QuantizedWeight, ...], bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` of `x` with the row segments `weights` stacked, computed in float32 (as HF runs a dequantized
    GGUF), in x's dtype."""
    dense = torch.cat([dequantize(w) for w in weights]) if len(weights) > 1 else dequantize(weights[0])
    return F.linear(x.float(), dense, None if bias is None else bias.float()).to(x.dtype)


# Rows of a weight the torch path widens at a time: its float32 copy stays a few MB, never the whole weight.
REFERENCE_CHUNK_ROWS = 512


def chunked_quantized_linear(
    x: torch.Tensor, weights: tuple[QuantizedWeight, ...], bias: torch.Tensor | None
) -> torch.Tensor:
    """`quantized_linear`, widening `REFERENCE_CHUNK_ROWS` rows of the weight at a time: the torch backend's path
    (any device)."""
    x_float = x.float()
    out = torch.empty(x.shape[0], sum(w.out_features for w in weights), dtype=torch.float32, device=x.device)
    first = 0
    for weight in weights:
        for start in range(0, weight.out_features, REFERENCE_CHUNK_ROWS):
            chunk = weight.rows(start, min(REFERENCE_CHUNK_ROWS, weight.out_features - start))
            out[:, first + start : first + start + chunk.out_features] = x_float @ dequantize(chunk).T
        first += weight.out_features
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


def _half(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 at byte `offset` of each block, as float32 [blocks, 1]."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).float()


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return _half(blocks, 0) * blocks[:, 2:].contiguous().view(torch.int8).float()


def _nibbles(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (packed & 0x0F).float(), (packed >> 4).float()


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    low, high = _nibbles(blocks[:, 2:])
    return _half(blocks, 0) * (torch.cat([low, high], dim=1) - 8)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    bits = torch.arange(8, dtype=torch.uint8, device=blocks.device)
    high_bits = (blocks[:, 2:6].unsqueeze(-1) >> bits) & 1  # [block, byte, bit]
    low, high = _nibbles(blocks[:, 6:])
    quants = torch.cat([low, high], dim=1) + high_bits.reshape(-1, 32).float() * 16
    return _half(blocks, 0) * (quants - 16)


def _q4_k_scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins of each block from its 12 bytes: sub-blocks 0-3 in the low 6 bits of bytes
    0-3 (scales) and 4-7 (mins); sub-blocks 4-7 in the nibbles of bytes 8-11, with their top 2 bits in the top 2
    bits of bytes 0-3 (scales) and 4-7 (mins)."""
    packed = packed.long()
    low_scales, low_mins, high = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([low_scales & 63, (high & 0x0F) | ((low_scales >> 6) << 4)], dim=1)
    mins = torch.cat([low_mins & 63, (high >> 4) | ((low_mins >> 6) << 4)], dim=1)
    return scales.float(), mins.float()


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    scales, mins = _q4_k_scales_and_mins(blocks[:, 4:16])
    low, high = _nibbles(blocks[:, 16:].reshape(-1, 4, 32))
    quants = torch.stack([low, high], dim=2).reshape(-1, 8, 32)  # sub-blocks 2j (low), 2j + 1 (high)
    values = (_half(blocks, 0) * scales).unsqueeze(-1) * quants - (_half(blocks, 2) * mins).unsqueeze(-1)
    return values.reshape(-1, 256)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Each half of 128 values has 64 bytes of low nibbles and 32 of high pairs: value 32i + l (i = 0..3, l < 32)
    takes its low nibble from byte l (i even) or l + 32 (i odd), low (i < 2) or high (i >= 2) nibble, and its high
    bits from pair i of high byte l."""
    low_bytes = blocks[:, :128].reshape(-1, 2, 2, 32).long()  # [block, half, byte group (l or l + 32), l]
    high_bytes = blocks[:, 128:192].reshape(-1, 2, 1, 32).long()
    low = torch.stack([low_bytes & 0x0F, low_bytes >> 4], dim=2)  # [block, half, nibble, byte group, l]
    shifts = torch.arange(4, device=blocks.device).reshape(1, 1, 2, 2, 1) * 2  # i = 2 * nibble + byte group
    high = (high_bytes.unsqueeze(2) >> shifts) & 3
    quants = ((low | (high << 4)) - 32).reshape(-1, 16, 16).float()
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    return ((_half(blocks, 208) * scales).unsqueeze(-1) * quants).reshape(-1, 256)


_DEQUANTIZERS = {
    "q8_0": _q8_0,
    "q4_0": _q4_0,
    "q4_k": _q4_k,
    "q6_k": _q6_k,
    "q5_0": _q5_0,
    "f32": lambda blocks: blocks.contiguous().view(torch.float32),
    "f16": lambda blocks: blocks.contiguous().view(torch.float16).float(),
    "bf16": lambda blocks: blocks.contiguous().view(torch.bfloat16).float(),
}
