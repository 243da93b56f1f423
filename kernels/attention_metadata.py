"""What an attention call needs to know about the batch, passed explicitly to every layer."""

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Layout of one step's packed tokens over the paged KV cache.

    The step's new tokens of all requests are packed along one axis: request i owns rows
    `query_start_loc[i] : query_start_loc[i + 1]`, which are its positions
    `seq_lens[i] - query_len_i ... seq_lens[i] - 1`. Keys and values of positions
    `[0, seq_lens[i])` live in the blocks `block_tables[i]` (padded with 0 past its last block).
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot = block_id * block_size + offset
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including the new tokens
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # Derived once per step rather than in every layer's attention call.
    num_decodes: int = field(init=False)  # the leading requests with one new token (the scheduler puts decodes first)
    max_query_len: int = field(init=False)
    max_seq_len: int = field(init=False)

    def __post_init__(self) -> None:
        lens = self.query_lens_cpu
        num_decodes = next((i for i, query_len in enumerate(lens) if query_len != 1), len(lens))
        object.__setattr__(self, "num_decodes", num_decodes)
        object.__setattr__(self, "max_query_len", max(lens, default=0))
        object.__setattr__(self, "max_seq_len", max(self.seq_lens_cpu, default=0))

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)
