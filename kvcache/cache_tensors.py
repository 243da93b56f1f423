"""KV cache tensors: per layer, K and V of shape [num_blocks, block_size, num_kv_heads, head_dim]."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape and dtype of one model's KV cache; sizes the pool from a byte budget."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int = 16

    @property
    def bytes_per_token(self) -> int:
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size

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
    """The paged K and V tensors of every layer."""

    spec: KVCacheSpec
    num_blocks: int
    key_caches: list[torch.Tensor]
    value_caches: list[torch.Tensor]

    @classmethod
    def allocate(cls, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> "KVCache":
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        # Zero-filled so stale slots read by padded gathers are finite numbers.
        keys = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
        values = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
        return cls(spec=spec, num_blocks=num_blocks, key_caches=keys, value_caches=values)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.spec.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.spec.bytes_per_block
