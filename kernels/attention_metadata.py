"""What an attention call needs to know about the batch, passed explicitly to every layer."""

from dataclasses import dataclass

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

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)
