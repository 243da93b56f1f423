"""What an attention call needs to know about the batch, passed explicitly to every layer."""

from dataclasses import dataclass, field
from functools import cached_property

import torch

# A sequence with up to this many new tokens can have each of them attended as a decode of its own (`decode_rows`):
# one pass over its context per token, which beats a prompt-chunk kernel's setup for a few tokens (draft
# verification: a request's last token and its drafts), not for a chunk of hundreds.
MAX_QUERY_LEN_AS_DECODES = 16


@dataclass(frozen=True)
class DecodeRows:
    """The leading `num_seqs` sequences' `num_tokens` new tokens as decode queries: token j of a sequence of
    context L and q new tokens reads that sequence's blocks up to its own position, L - q + 1 + j positions."""

    num_seqs: int
    num_tokens: int
    block_tables: torch.Tensor  # [num_tokens, max_num_blocks] int32
    seq_lens: torch.Tensor  # [num_tokens] int32


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

    @cached_property
    def decode_rows(self) -> DecodeRows:
        """The leading sequences of at most MAX_QUERY_LEN_AS_DECODES new tokens, as one decode query per token (built
        once a step, on first use): the tables themselves when each has one token."""
        lens = self.query_lens_cpu
        num_seqs = next((i for i, query_len in enumerate(lens) if query_len > MAX_QUERY_LEN_AS_DECODES), len(lens))
        if num_seqs == self.num_decodes:
            return DecodeRows(num_seqs, num_seqs, self.block_tables[:num_seqs], self.seq_lens[:num_seqs])
        seq_index, seq_lens = [], []
        for i, (query_len, seq_len) in enumerate(zip(lens[:num_seqs], self.seq_lens_cpu, strict=False)):
            seq_index += [i] * query_len
            seq_lens += range(seq_len - query_len + 1, seq_len + 1)
        device = self.block_tables.device
        block_tables = self.block_tables.index_select(0, torch.tensor(seq_index, device=device))
        row_seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        return DecodeRows(num_seqs, len(seq_index), block_tables, row_seq_lens)
