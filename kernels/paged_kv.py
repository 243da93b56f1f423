"""One layer's paged KV cache as the attention backends see it."""

from dataclasses import dataclass

import torch

INT8_MAX = 127


@dataclass(frozen=True)
class PagedKV:
    """K and V of one layer: [num_blocks, block_size, num_kv_heads, head_dim] each, in the model's
    dtype or int8. An int8 cache also has fp32 scales [num_blocks, block_size, num_kv_heads], one per
    token and head: the stored vector is `data * scale`."""

    key: torch.Tensor
    value: torch.Tensor
    key_scale: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        has_scales = self.key_scale is not None and self.value_scale is not None
        if (self.key.dtype == torch.int8) != has_scales:
            raise ValueError("an int8 KV cache needs key and value scales, and only an int8 cache has them")

    @property
    def quantized(self) -> bool:
        return self.key.dtype == torch.int8

    @property
    def block_size(self) -> int:
        return self.key.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.key.shape[2]
