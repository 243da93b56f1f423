"""The model's adapter slots: every adaptable linear layer gets `LoraStacks` with `max_loras` slots of `max_rank`, and
an adapter is copied into a slot (or a slot cleared) as one unit across all layers.

Adaptable: the attention projections and the dense MLPs (Qwen2-MoE's shared expert too); not the LM head, the
embeddings, a router or the experts (an adapter that targets them is refused when it is read). A packed layer's parts
are adapted by the names of the checkpoint's projections (`q_proj`, ...), or whole by the packed name a fused
checkpoint uses (Phi-3's `qkv_proj`: its A is then each part's A, and B is split by the parts' rows).
"""

from dataclasses import dataclass

import torch
from torch import nn

from kvserve.engine.lora.peft_adapter import LoraAdapter, LoraAdapterError
from kvserve.engine.models.layers import LayerLora, Linear, PackedLinear
from kvserve.kernels.lora import LoraBatch, LoraStacks

# Linear layers that take no adapter: the output head and mixture-of-experts gates.
_NOT_ADAPTED = ("lm_head", ".mlp.gate", ".shared_expert_gate")


@dataclass(frozen=True)
class _Target:
    """Where an adapted module's delta goes: a layer, and which of its parts (all of them for a fused name)."""

    layer: Linear
    parts: tuple[int, ...]


class ModelLoraSlots:
    def __init__(
        self, model: nn.Module, max_loras: int, max_rank: int, batch: LoraBatch, dtype: torch.dtype,
        device: torch.device,
    ) -> None:  # fmt: skip
        self.max_loras, self.max_rank, self.batch = max_loras, max_rank, batch
        self._targets: dict[str, _Target] = {}
        self._layers: list[Linear] = []
        for module_name, module in model.named_modules():
            if not isinstance(module, Linear) or module_name.endswith(_NOT_ADAPTED):
                continue
            parts = module.parts if isinstance(module, PackedLinear) else {module_name.rpartition(".")[2]: None}
            part_rows, first = [], 0
            prefix = module_name.rpartition(".")[0]
            for index, (part, rows) in enumerate(parts.items()):
                rows = module.out_features if rows is None else rows
                part_rows.append((first, rows))
                first += rows
                self._targets[f"{prefix}.{part}"] = _Target(module, (index,))
            self._targets[module_name] = _Target(module, tuple(range(len(parts))))
            stacks = LoraStacks(
                a=torch.zeros(max_loras, len(parts) * max_rank, module.in_features, dtype=dtype, device=device),
                # Stored [out, slots, rank]: the torch path's dense pass reads the first slots of each row as one
                # [out, slots * rank] matrix, without a copy.
                b=torch.zeros(module.out_features, max_loras, max_rank, dtype=dtype, device=device).transpose(0, 1),
                part_rows=tuple(part_rows),
            )
            module.lora = LayerLora(stacks, batch)
            self._layers.append(module)

    @property
    def nbytes(self) -> int:
        return sum(layer.lora.stacks.a.nbytes + layer.lora.stacks.b.nbytes for layer in self._layers)

    def check(self, adapter: LoraAdapter) -> None:
        """`LoraAdapterError` unless every module the adapter adapts is one of this model's, with matching shapes."""
        for module, (a, b) in adapter.weights.items():
            target = self._targets.get(module)
            if target is None:
                raise LoraAdapterError(f"adapter {adapter.name!r} adapts {module}, which this model has no layer for")
            stacks = target.layer.lora.stacks
            rows = sum(stacks.part_rows[part][1] for part in target.parts)
            if a.shape[1] != target.layer.in_features or b.shape[0] != rows:
                raise LoraAdapterError(
                    f"adapter {adapter.name!r}: {module} is [{b.shape[0]}, {a.shape[1]}] in the adapter but "
                    f"[{rows}, {target.layer.in_features}] in the model"
                )

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy `adapter` into `slot` of every layer (layers it does not adapt get zeros there)."""
        self.clear(slot)
        rank = self.max_rank
        with torch.no_grad():
            for module, (a, b) in adapter.weights.items():
                target = self._targets[module]
                stacks, r = target.layer.lora.stacks, a.shape[0]
                b_row = 0
                for part in target.parts:
                    first, rows = stacks.part_rows[part]
                    stacks.a[slot, part * rank : part * rank + r].copy_(a, non_blocking=True)
                    stacks.b[slot, first : first + rows, :r].copy_(b[b_row : b_row + rows], non_blocking=True)
                    b_row += rows

    def clear(self, slot: int) -> None:
        for layer in self._layers:
            layer.lora.stacks.a[slot].zero_()
            layer.lora.stacks.b[slot].zero_()
