"""What rank 0 sends the workers each step: the packed tokens and their layout over the paged cache.

One broadcast of a fixed-size header (the counts), then one of the payload: token ids, query start
offsets, context lengths, the step's block-table rows (only the columns its longest sequence uses),
LongRoPE's sequence lengths when the model has them, and the rows whose logits are wanted. All int64 on
the host, O(tokens + sequences x blocks): never the scheduler's state. Each worker derives positions
and cache slots from it on its own device, as rank 0 does.
"""

from dataclasses import dataclass

import torch

from kvserve.engine.parallel.group import TensorParallelGroup
from kvserve.engine.step_inputs import InputBuffers, StepInputs, positions_and_slots
from kvserve.kernels import AttentionMetadata

_HEADER_SIZE = 6  # running, num_tokens, num_seqs, num_block_columns, has_sequence_lens, num_logit_rows


@dataclass(frozen=True)
class StepMessage:
    input_ids: torch.Tensor  # [num_tokens]
    query_start_loc: torch.Tensor  # [num_seqs + 1]
    seq_lens: torch.Tensor  # [num_seqs]
    block_tables: torch.Tensor  # [num_seqs, num_block_columns]
    sequence_lens: torch.Tensor | None  # [num_seqs], LongRoPE models only
    logit_rows: torch.Tensor  # [num_logit_rows]: the token rows whose logits the step computes

    @classmethod
    def of_prepared(cls, buffers: InputBuffers, extra_rows: list[int] | None) -> "StepMessage":
        """Rank 0: the step `buffers.prepare` just laid out, from its host buffers (no device read)."""
        counts = buffers.prepared
        seq_lens = buffers.host_seq_lens[: counts.num_seqs]
        num_columns = -(-int(seq_lens.max()) // buffers.block_size) if counts.num_seqs else 0
        table_rows = buffers.host_rows[: counts.num_seqs]
        logit_rows = buffers.host_sample_rows[: counts.num_sample_rows]
        if extra_rows:
            logit_rows = torch.cat([logit_rows, torch.tensor(extra_rows, dtype=torch.int64)])
        return cls(
            input_ids=buffers.host_input_ids[: counts.num_tokens],
            query_start_loc=buffers.host_query_start_loc[: counts.num_seqs + 1],
            seq_lens=seq_lens,
            block_tables=buffers.block_tables.host.index_select(0, table_rows)[:, :num_columns],
            sequence_lens=buffers.host_sequence_lens[: counts.num_seqs] if buffers.long_rope is not None else None,
            logit_rows=logit_rows,
        )

    def step_inputs(self, device: torch.device, block_size: int, long_rope: tuple[int, int] | None) -> StepInputs:
        """A worker: the model's inputs on `device`, positions and slots derived as rank 0 derives them."""
        query_start_loc, seq_lens = self.query_start_loc.to(device), self.seq_lens.to(device)
        block_tables = self.block_tables.to(device)
        sequence_lens = self.sequence_lens.to(device) if self.sequence_lens is not None else None
        num_tokens = self.input_ids.numel()
        token_numbers = torch.arange(num_tokens, device=device)
        seq_numbers = torch.arange(seq_lens.shape[0], device=device)
        positions, slot_mapping = positions_and_slots(
            query_start_loc, seq_lens, block_tables, block_size, token_numbers, seq_numbers, long_rope, sequence_lens
        )
        metadata = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            query_lens_cpu=(self.query_start_loc[1:] - self.query_start_loc[:-1]).tolist(),
            seq_lens_cpu=self.seq_lens.tolist(),
        )
        return StepInputs(self.input_ids.to(device), positions, metadata, self.logit_rows.to(device))

    @property
    def nbytes(self) -> int:
        parts = (self.input_ids, self.query_start_loc, self.seq_lens, self.block_tables, self.logit_rows)
        return 8 * (_HEADER_SIZE + sum(part.numel() for part in parts) + self._num_sequence_lens)

    @property
    def _num_sequence_lens(self) -> int:
        return 0 if self.sequence_lens is None else self.sequence_lens.numel()

    def send(self, group: TensorParallelGroup) -> None:
        """Rank 0: broadcast this step to the workers."""
        num_seqs, num_columns = self.block_tables.shape
        header = [1, self.input_ids.numel(), num_seqs, num_columns, int(self.sequence_lens is not None),
                  self.logit_rows.numel()]  # fmt: skip
        group.broadcast_from_first(torch.tensor(header, dtype=torch.int64), announces_step=True)
        parts = [self.input_ids, self.query_start_loc, self.seq_lens, self.block_tables.reshape(-1), self.logit_rows]
        if self.sequence_lens is not None:
            parts.append(self.sequence_lens)
        group.broadcast_from_first(torch.cat([part.to(torch.int64) for part in parts]))

    @classmethod
    def receive(cls, group: TensorParallelGroup) -> "StepMessage | None":
        """A worker: the next step, or None when rank 0 says stop (`send_stop`)."""
        header = group.broadcast_from_first(torch.zeros(_HEADER_SIZE, dtype=torch.int64), announces_step=True).tolist()
        running, num_tokens, num_seqs, num_columns, has_sequence_lens, num_rows = header
        if not running:
            return None
        sizes = [num_tokens, num_seqs + 1, num_seqs, num_seqs * num_columns, num_rows]
        sizes += [num_seqs] if has_sequence_lens else []
        payload = group.broadcast_from_first(torch.empty(sum(sizes), dtype=torch.int64))
        parts = payload.split(sizes)
        return cls(
            input_ids=parts[0],
            query_start_loc=parts[1].to(torch.int32),
            seq_lens=parts[2].to(torch.int32),
            block_tables=parts[3].view(num_seqs, num_columns).to(torch.int32),
            sequence_lens=parts[5] if has_sequence_lens else None,
            logit_rows=parts[4],
        )


def send_stop(group: TensorParallelGroup) -> None:
    """Rank 0: tell the workers to leave their loop."""
    group.broadcast_from_first(torch.zeros(_HEADER_SIZE, dtype=torch.int64), announces_step=True)
