"""KV cache tensors: per layer, K and V of shape [num_blocks, block_size, num_kv_heads, head_dim], in the
model's dtype or int8; an int8 cache adds fp32 scales [num_blocks, block_size, num_kv_heads] for each."""

from dataclasses import dataclass

import torch

SCALE_DTYPE = torch.float32


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape and dtype of one model's KV cache; sizes the pool from a byte budget, scales included."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # of K and V: the model's, or torch.int8
    block_size: int = 16

    @property
    def quantized(self) -> bool:
        return self.dtype == torch.int8

    @property
    def bytes_per_token(self) -> int:
        element_size = torch.empty((), dtype=self.dtype).element_size()
        scale_bytes = SCALE_DTYPE.itemsize if self.quantized else 0
        return 2 * self.num_layers * self.num_kv_heads * (self.head_dim * element_size + scale_bytes)

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    def num_blocks_for_budget(self, budget_bytes: int) -> int:
        num_blocks = budget_bytes // self.bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"KV cache budget of {budget_bytes} bytes holds no block (one block needs {self.bytes_per_block} bytes)"
            )
        return num_blocks


@dataclass
class KVCache:
    """The paged K and V tensors of every layer (and their scales for an int8 cache; else empty lists).

    Besides the `num_blocks` the allocator hands out, the tensors hold one more, the padding block
    (`padding_block`, the last): the rows a padded batch adds read and write only there.
    """

    spec: KVCacheSpec
    num_blocks: int
    key_caches: list[torch.Tensor]
    value_caches: list[torch.Tensor]
    key_scales: list[torch.Tensor]
    value_scales: list[torch.Tensor]

    @classmethod
    def allocate(cls, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> "KVCache":
        shape = (num_blocks + 1, spec.block_size, spec.num_kv_heads, spec.head_dim)
        num_scale_layers = spec.num_layers if spec.quantized else 0

        def tensors(count: int, shape: tuple, dtype: torch.dtype) -> list[torch.Tensor]:
            return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(count)]

        return cls(
            spec=spec,
            num_blocks=num_blocks,
            key_caches=tensors(spec.num_layers, shape, spec.dtype),
            value_caches=tensors(spec.num_layers, shape, spec.dtype),
            key_scales=tensors(num_scale_layers, shape[:-1], SCALE_DTYPE),
            value_scales=tensors(num_scale_layers, shape[:-1], SCALE_DTYPE),
        )

    @property
    def padding_block(self) -> int:
        return self.num_blocks

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.spec.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.spec.bytes_per_block
