"""Group-quantized weights: the engine's form of a linear layer's weight as compressed-tensors checkpoints store it
(vLLM's main quantized format, made by llm-compressor), with the torch reference that dequantizes it and the
reference linear layer on it.

A weight [out_features, in_features] holds integer or float8 values, a scale per row and group of `group_size`
input features (a group as wide as the row: a scale per channel), and for asymmetric integers a zero point per
scale; w = (q - zero_point) * scale, computed in the scales' dtype exactly as compressed-tensors decompresses it
(so the weights equal those HF transformers runs, bit for bit). Values are kept as:

- 8-bit integers: int8 [out, in];
- 4-bit integers: uint8 [out, in / 2], value 2j in the low nibble of byte j and 2j + 1 in the high one, offset by
  8 (q + 8 in 0..15): the checkpoint's int32 words as bytes, unchanged;
- float8 (e4m3fn): [out, in].

Some schemes also quantize a layer's input, dynamically per token (W8A8: int8; FP8_DYNAMIC: float8): the layer
then multiplies the input's quantized-and-dequantized values (`quantize_activations`), as compressed-tensors' own
forward does, so the products are those of the quantized operands.

On a CPU the C++ kernels (kernels/csrc/cpu_block_quant.cpp) compute every value type with float32 or bfloat16
scales in groups of a multiple of 32, widened in registers as `dequantize` widens them; on CUDA a Triton kernel
(kernels/triton_group_quant.py) groups of a multiple of 16, and FP8_DYNAMIC layers `torch._scaled_mm`
(kernels/fp8_scaled_mm.py); the rest takes the torch path here (`chunked_group_quantized_linear`).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Activation quantization kinds: dynamic, symmetric, one scale per token.
ACTIVATION_KINDS = ("int8", "fp8")
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


class GroupQuantError(ValueError):
    """A weight's tensors do not fit together (shapes, dtypes), or a slice of it cuts through a group."""


@dataclass(eq=False)
class GroupQuantizedWeight:
    values: torch.Tensor
    num_bits: int  # 4 or 8
    scales: torch.Tensor  # [out, in / group_size], in the checkpoint's dtype
    zero_points: torch.Tensor | None  # int8 [out, in / group_size] (asymmetric integers only)
    group_size: int
    in_features: int
    activations: str | None = None  # one of ACTIVATION_KINDS: the layer's input is quantized per token

    def __post_init__(self) -> None:
        columns = self.in_features // 2 if self.num_bits == 4 else self.in_features
        if self.values.dim() != 2 or self.values.shape[1] != columns or self.values.dtype not in _VALUE_DTYPES:
            raise GroupQuantError(
                f"{self.num_bits}-bit values for rows of {self.in_features} are [rows, {columns}] of "
                f"{'uint8' if self.num_bits == 4 else 'int8 or float8_e4m3fn'}, got {self.values.dtype} "
                f"{list(self.values.shape)}"
            )
        if self.in_features % self.group_size:
            raise GroupQuantError(f"groups of {self.group_size} do not divide rows of {self.in_features}")
        groups = (self.out_features, self.in_features // self.group_size)
        if tuple(self.scales.shape) != groups:
            raise GroupQuantError(f"scales are {list(self.scales.shape)}, expected {list(groups)}")
        if self.zero_points is not None and tuple(self.zero_points.shape) != groups:
            raise GroupQuantError(f"zero points are {list(self.zero_points.shape)}, expected {list(groups)}")
        if self.activations not in (None, *ACTIVATION_KINDS):
            raise GroupQuantError(f"activation quantization {self.activations!r} is not one of {ACTIVATION_KINDS}")

    @property
    def out_features(self) -> int:
        return self.values.shape[0]

    @property
    def scheme(self) -> tuple:
        """What must agree for two weights to be computed as one: all but the values and scales."""
        return (self.values.dtype, self.num_bits, self.scales.dtype, self.zero_points is not None,
                self.group_size, self.in_features, self.activations)  # fmt: skip

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.values, self.scales, self.zero_points) if t is not None]

    def rows(self, start: int, length: int) -> "GroupQuantizedWeight":
        """Output features [start, start + length), as views."""
        zero_points = None if self.zero_points is None else self.zero_points[start : start + length]
        return self._with(self.values[start : start + length], self.scales[start : start + length], zero_points,
                          self.in_features)  # fmt: skip

    def columns(self, start: int, length: int) -> "GroupQuantizedWeight":
        """Input features [start, start + length): whole groups only, unless a row is one group (a scale per
        channel), whose scale holds for any of its features."""
        per_value = 2 if self.num_bits == 4 else 1
        if self.group_size == self.in_features:
            if start % per_value or length % per_value:
                raise GroupQuantError(f"4-bit values are two a byte: columns {start}..{start + length} split one")
            group_size, first_group, groups = length, 0, 1
        else:
            if start % self.group_size or length % self.group_size:
                raise GroupQuantError(
                    f"groups of {self.group_size} input features: columns {start}..{start + length} cut through one"
                )
            group_size, first_group, groups = self.group_size, start // self.group_size, length // self.group_size
        share = slice(first_group, first_group + groups)
        return GroupQuantizedWeight(
            self.values[:, start // per_value : (start + length) // per_value].contiguous(),
            self.num_bits,
            self.scales[:, share].contiguous(),
            None if self.zero_points is None else self.zero_points[:, share].contiguous(),
            group_size,
            length,
            self.activations,
        )

    def clone(self) -> "GroupQuantizedWeight":
        """Copies of its tensors (a view of a slice would keep the whole weight's alive)."""
        zero_points = None if self.zero_points is None else self.zero_points.clone()
        return self._with(self.values.clone(), self.scales.clone(), zero_points, self.in_features)

    def to(self, device: torch.device) -> "GroupQuantizedWeight":
        if self.values.device == device:
            return self
        zero_points = None if self.zero_points is None else self.zero_points.to(device)
        return self._with(self.values.to(device), self.scales.to(device), zero_points, self.in_features)

    def _with(self, values, scales, zero_points, in_features) -> "GroupQuantizedWeight":
        return GroupQuantizedWeight(values, self.num_bits, scales, zero_points, self.group_size, in_features,
                                    self.activations)  # fmt: skip


_VALUE_DTYPES = (torch.int8, torch.uint8, torch.float8_e4m3fn)


def concat_rows(weights: list[GroupQuantizedWeight]) -> GroupQuantizedWeight:
    """One weight of all rows, in order (the parts of a packed projection, which must share a scheme)."""
    first = weights[0]
    if any(weight.scheme != first.scheme for weight in weights):
        raise GroupQuantError("the parts of one projection are quantized differently")
    zero_points = None if first.zero_points is None else torch.cat([w.zero_points for w in weights])
    return first._with(
        torch.cat([w.values for w in weights]), torch.cat([w.scales for w in weights]), zero_points, first.in_features
    )


def padded_rows(weight: GroupQuantizedWeight, rows: int) -> GroupQuantizedWeight:
    """The weight with rows of zero values after its own up to `rows` (the vocabulary padding of a sharded head)."""
    extra = rows - weight.out_features
    zero_byte = 0x88 if weight.num_bits == 4 else 0  # a 4-bit zero is stored as 8 in each nibble
    values = torch.full((extra, weight.values.shape[1]), zero_byte, dtype=torch.uint8).view(weight.values.dtype)
    scales = torch.ones(extra, weight.scales.shape[1], dtype=weight.scales.dtype)
    zero_points = None
    if weight.zero_points is not None:
        zero_points = torch.cat([weight.zero_points, torch.zeros(extra, weight.zero_points.shape[1], dtype=torch.int8)])
    return weight._with(torch.cat([weight.values, values]), torch.cat([weight.scales, scales]), zero_points,
                        weight.in_features)  # fmt: skip


def integer_values(weight: GroupQuantizedWeight) -> torch.Tensor:
    """The stored values as integers [out, in] (q, without the 4-bit offset), or the float8 values."""
    if weight.num_bits != 4:
        return weight.values
    low = (weight.values & 0x0F).to(torch.int8) - 8
    high = (weight.values >> 4).to(torch.int8) - 8
    return torch.stack([low, high], dim=-1).reshape(weight.out_features, weight.in_features)


def dequantize(weight: GroupQuantizedWeight) -> torch.Tensor:
    """The weight as float32 [out_features, in_features]: (q - zero_point) * scale in the scales' dtype, as
    compressed-tensors computes it, then widened (the reference; no kernel keeps this copy)."""
    dtype = weight.scales.dtype
    groups = weight.in_features // weight.group_size
    values = integer_values(weight).to(dtype).reshape(weight.out_features, groups, weight.group_size)
    if weight.zero_points is not None:
        values = values - weight.zero_points.to(dtype).unsqueeze(-1)
    return (values * weight.scales.unsqueeze(-1)).reshape(weight.out_features, weight.in_features).float()


def token_largest(x: torch.Tensor) -> torch.Tensor:
    """max |x| of each token [tokens, 1] (the largest of max(x, 0) and -min(x, 0), as compressed-tensors takes it)."""
    return torch.maximum(x.amin(dim=-1, keepdim=True).neg().clamp(min=0), x.amax(dim=-1, keepdim=True).clamp(min=0))


# Each activation kind's least and greatest value, and the half range a token's max |x| is scaled to.
_ACTIVATION_RANGES = {"int8": (-128.0, 127.0), "fp8": (-FP8_MAX, FP8_MAX)}
_ACTIVATION_HALF_RANGES = {"int8": 127.5, "fp8": FP8_MAX}


def quantized_activations(
    x: torch.Tensor, kind: str, largest: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, features] quantized per token, symmetrically, as compressed-tensors' dynamic activation
    quantization does: scale = max|x| / (half the type's range: 127.5 for int8, 448 for float8; the float32 epsilon
    where a token is all zeros), values clamped to the type's range and rounded (to nearest even integer; to float8
    by the cast). Returns the values (int8's as whole numbers in x's dtype, float8's as float8) and each token's
    scale [tokens, 1]. `largest`: each token's max|x| if x is a share of its features (a tensor-parallel rank's),
    taken over all of them."""
    low, high = _ACTIVATION_RANGES[kind]
    scale = (token_largest(x) if largest is None else largest) / _ACTIVATION_HALF_RANGES[kind]
    scale = torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)
    clamped = torch.clamp(x / scale, low, high)
    values = torch.round(clamped) if kind == "int8" else clamped.to(torch.float8_e4m3fn)
    return values, scale


def quantize_activations(x: torch.Tensor, kind: str, largest: torch.Tensor | None = None) -> torch.Tensor:
    """x quantized and dequantized per token (`quantized_activations`): what compressed-tensors' forward multiplies."""
    values, scale = quantized_activations(x, kind, largest)
    return values.to(x.dtype) * scale


def group_quantized_linear(x: torch.Tensor, weight: GroupQuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` of x [rows, in] with the dequantized weight (the input quantized first where the scheme says),
    in float32, in x's dtype: the reference."""
    x_float = x.float() if weight.activations is None else quantize_activations(x.float(), weight.activations)
    return F.linear(x_float, dequantize(weight), None if bias is None else bias.float()).to(x.dtype)


# Rows of a weight the torch path widens at a time: its float32 copy stays a few MB, never the whole weight.
CHUNK_ROWS = 512


def chunked_group_quantized_linear(
    x: torch.Tensor, weight: GroupQuantizedWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """`group_quantized_linear`, widening `CHUNK_ROWS` rows of the weight at a time: the torch path."""
    x_float = x.float() if weight.activations is None else quantize_activations(x.float(), weight.activations)
    out = torch.empty(x.shape[0], weight.out_features, dtype=torch.float32, device=x.device)
    for start in range(0, weight.out_features, CHUNK_ROWS):
        length = min(CHUNK_ROWS, weight.out_features - start)
        out[:, start : start + length] = x_float @ dequantize(weight.rows(start, length)).T
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)
