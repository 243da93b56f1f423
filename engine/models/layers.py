"""Layers the decoders share: linear projections (packed ones too) and RMSNorm's parameters.

A linear layer's GEMM is the kernel backend's, on the backend's own form of the weight where it keeps one,
made once at load time (`prepare_weights`). On a CPU that is oneDNN's blocked layout: float32 `F.linear` goes to
MKL's sgemm, which on the AMD EPYC machines here runs its AVX2 code (`F.linear` took 2.3-4.0x the packed path's
time for every projection of the benchmark model), and the packed weight saves oneDNN a reorder each call
(10-25% at decode batch sizes, in bfloat16 too). BENCHMARKS.md has the figures (`benchmarks/cpu_gemm.py`). The
packed copy sits beside the weight, so on a CPU the linear layers' weights take twice their memory.

A layer may instead hold a block-quantized weight (GGUF's, kernels/block_quant.py), as row segments in the order of
its rows (the parts of a packed projection may be quantized apart, in different formats), or a group-quantized one
(compressed-tensors', kernels/group_quant.py); it then has no dense weight at all, and the backend's
`quantized_linear` or `group_quantized_linear` computes it.
"""

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels import KernelBackend
from kvserve.kernels.block_quant import QuantizedWeight, dequantize
from kvserve.kernels.group_quant import GroupQuantizedWeight, quantize_activations, token_largest
from kvserve.kernels.lora import LoraBatch, LoraStacks

if TYPE_CHECKING:
    from kvserve.engine.parallel.group import TensorParallelGroup


@dataclass(frozen=True)
class LayerLora:
    """A linear layer's adapter slots, and the worker's batch that says which slot each token of a step uses (a
    buffer rewritten every step, which a captured decode graph reads as it reads the other step inputs)."""

    stacks: LoraStacks
    batch: LoraBatch


class Linear(nn.Linear):
    prepared: object | None = None  # the backend's own form of the weight (`prepare_weights`), if it keeps one
    quantized: tuple[QuantizedWeight, ...] | None = None  # the weight's row segments, when it is block-quantized
    grouped: GroupQuantizedWeight | None = None  # the weight, when it is group-quantized
    lora: LayerLora | None = None  # its adapters, when the engine serves LoRA adapters

    def forward(self, x: torch.Tensor, backend: KernelBackend) -> torch.Tensor:
        return self.add_lora(self.base_forward(x, backend), x, backend)

    def base_forward(self, x: torch.Tensor, backend: KernelBackend) -> torch.Tensor:
        """The layer without its adapters."""
        if self.quantized is not None:
            return backend.quantized_linear(x, self.quantized, self.bias)
        if self.grouped is not None:
            return backend.group_quantized_linear(x, self.grouped, self.bias)
        return backend.linear(x, self.weight, self.bias, self.prepared)

    def add_lora(self, out: torch.Tensor, x: torch.Tensor, backend: KernelBackend) -> torch.Tensor:
        """`out` plus the delta of each token's adapter, if the step has any."""
        lora = self.lora
        if lora is None or lora.batch.is_empty:
            return out
        return backend.add_lora(out, x, lora.stacks, lora.batch)

    def quantize(self, segments: tuple[QuantizedWeight, ...]) -> None:
        """Hold the weight as block-quantized row segments instead of a dense parameter (set before the model is
        allocated, so the dense weight never is)."""
        self._check_fits(sum(segment.out_features for segment in segments), {s.in_features for s in segments})
        self.quantized = segments
        self.weight = None

    def quantize_groups(self, weight: GroupQuantizedWeight) -> None:
        """Hold the weight group-quantized instead of as a dense parameter (set before the model is allocated)."""
        self._check_fits(weight.out_features, {weight.in_features})
        self.grouped = weight
        self.weight = None

    def _check_fits(self, out_features: int, in_features: set[int]) -> None:
        if out_features != self.out_features or in_features != {self.in_features}:
            raise ValueError(f"quantized weight does not fit a [{self.out_features}, {self.in_features}] layer")

    def checkpoint_weight_names(self, module_name: str) -> list[str]:
        """The checkpoint names of the tensors its weight is made of, in the order of its rows."""
        return [f"{module_name}.weight"]


class RowParallelLinear(Linear):
    """A tensor-parallel rank's share of a projection over its slice of the input features (its heads, its
    slice of the intermediate size): the ranks' partial outputs are summed by one all-reduce. Only rank 0
    holds the bias (the others hold zeros), so it is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: "TensorParallelGroup") -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.group = group

    def forward(self, x: torch.Tensor, backend: KernelBackend) -> torch.Tensor:
        if self.grouped is not None and self.grouped.activations is not None:
            return self.group.all_reduce(self._with_inputs_quantized_over_ranks(x, backend))
        return self.group.all_reduce(super().forward(x, backend))

    def _with_inputs_quantized_over_ranks(self, x: torch.Tensor, backend: KernelBackend) -> torch.Tensor:
        """A token's input scale comes from all its features, which the ranks hold a share each of: the largest
        |x| over the ranks, then each rank's share quantized with it and multiplied as it is."""
        x_float = x.float()
        largest = self.group.all_reduce_max(token_largest(x_float))
        quantized = quantize_activations(x_float, self.grouped.activations, largest)
        out = backend.group_quantized_linear(quantized, replace(self.grouped, activations=None), self.bias)
        return self.add_lora(out.to(x.dtype), x, backend)


class VocabParallelEmbedding(nn.Embedding):
    """A tensor-parallel rank's rows of the embedding, [first_row, first_row + num_real_rows) of the vocabulary
    (then padding): each token's vector comes from the rank that holds it, the others add zeros."""

    def __init__(
        self, num_rows: int, hidden_size: int, first_row: int, num_real_rows: int, group: "TensorParallelGroup"
    ) -> None:
        super().__init__(num_rows, hidden_size)
        self.first_row, self.num_real_rows = first_row, num_real_rows
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local_ids = input_ids - self.first_row
        elsewhere = (local_ids < 0) | (local_ids >= self.num_real_rows)
        vectors = F.embedding(local_ids.masked_fill(elsewhere, 0), self.weight)
        return self.group.all_reduce(vectors.masked_fill_(elsewhere.unsqueeze(-1), 0))


class QuantizedEmbedding(nn.Module):
    """An embedding whose table is block-quantized: a lookup widens only the rows of the tokens asked for. With a
    tensor-parallel `group` it holds rows [first_row, first_row + its real rows) of the vocabulary, as
    `VocabParallelEmbedding` does."""

    def __init__(
        self, table: QuantizedWeight, dtype: torch.dtype, first_row: int = 0,
        group: "TensorParallelGroup | None" = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.quantized = table
        self.dtype = dtype
        self.first_row, self.group = first_row, group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local_ids = input_ids.flatten() - self.first_row
        elsewhere = (local_ids < 0) | (local_ids >= self.quantized.out_features)
        rows = self.quantized.data.index_select(0, local_ids.masked_fill(elsewhere, 0))
        vectors = dequantize(QuantizedWeight(self.quantized.format, rows, self.quantized.in_features)).to(self.dtype)
        if self.group is None:
            return vectors.view(*input_ids.shape, -1)
        vectors.masked_fill_(elsewhere.unsqueeze(-1), 0)
        return self.group.all_reduce(vectors).view(*input_ids.shape, -1)


def weight_bytes(model: nn.Module) -> int:
    """The bytes the model's weights are held in: its parameters and its layers' quantized tensors, each storage
    counted once (a tied head shares the embedding's)."""
    held = {parameter.data_ptr(): parameter.nbytes for parameter in model.parameters()}
    for module in model.modules():
        if isinstance(module, Linear) and module.quantized is not None:
            held.update({segment.data.data_ptr(): segment.nbytes for segment in module.quantized})
        elif isinstance(module, Linear) and module.grouped is not None:
            held.update({tensor.data_ptr(): tensor.nbytes for tensor in module.grouped.tensors()})
        elif isinstance(module, QuantizedEmbedding):
            held[module.quantized.data.data_ptr()] = module.quantized.nbytes
    return sum(held.values())


class PackedLinear(Linear):
    """Several projections of the same input computed as one GEMM (q/k/v, gate/up).

    `parts` maps each checkpoint projection (e.g. "q_proj") to its output size, in the order its
    rows are stacked; the loader copies each checkpoint tensor into its rows.
    """

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = parts

    def checkpoint_tensors(self, module_name: str) -> dict[str, torch.Tensor]:
        """The checkpoint names that fill this layer's rows: each part's, beside this module
        (`...self_attn.q_proj.weight` for `...self_attn.qkv_proj`). See `fused_checkpoint_names` for
        checkpoints that store the packed tensor whole (Phi-3)."""
        prefix = module_name.rpartition(".")[0]
        tensors = {}
        for name, parameter in self.named_parameters(recurse=False):
            offset = 0
            for part, size in self.parts.items():
                tensors[f"{prefix}.{part}.{name}"] = parameter.narrow(0, offset, size)
                offset += size
        return tensors

    def checkpoint_weight_names(self, module_name: str) -> list[str]:
        prefix = module_name.rpartition(".")[0]
        return [f"{prefix}.{part}.weight" for part in self.parts]

    def fused_checkpoint_names(self, module_name: str) -> dict[str, list[str]]:
        """The name of each packed parameter as a fused checkpoint stores it, and the part names it stands for."""
        prefix = module_name.rpartition(".")[0]
        return {
            f"{module_name}.{name}": [f"{prefix}.{part}.{name}" for part in self.parts]
            for name, _ in self.named_parameters(recurse=False)
        }

    def split(self, x: torch.Tensor, backend: KernelBackend) -> tuple[torch.Tensor, ...]:
        """The output of each part, as views of one GEMM's output."""
        return self(x, backend).split(tuple(self.parts.values()), dim=-1)


class RMSNorm(nn.Module):
    """RMSNorm's weight and epsilon; the backend computes it (in fp32, cast back, as HF does)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, backend: KernelBackend) -> torch.Tensor:
        return backend.rms_norm(x, self.weight, self.eps)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor, backend: KernelBackend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the sum is the residual stream the next layer adds to."""
        return backend.add_rms_norm(x, residual, self.weight, self.eps)
