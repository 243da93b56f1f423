"""A step's model inputs, written into buffers allocated once, with no wait on the device.

The host side of each step is O(new tokens + scheduled requests): token ids, query and context
lengths and block-table rows are written into host buffers (pinned on CUDA) and copied to their
device twins asynchronously; positions and slot mappings are derived on the device. Block tables
live on the device, one row per running request, and only the blocks allocated since the last step
are written into them (`BlockTableRows`).

Host buffers are rewritten only after the previous step's results came back, i.e. after the device
finished reading them; the sampler's one transfer back per step is that wait.
"""

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.kernels import AttentionMetadata
from kvserve.scheduler import Request, SchedulerOutput


def _host_buffer(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, pin_memory=device.type == "cuda")


def _device_twin(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The device buffer a host buffer is copied into; the host buffer itself when the device is the CPU."""
    return host if device.type == "cpu" else torch.zeros(host.shape, dtype=host.dtype, device=device)


def _to_device(host: torch.Tensor, device_buffer: torch.Tensor) -> torch.Tensor:
    if device_buffer.data_ptr() != host.data_ptr():
        device_buffer.copy_(host, non_blocking=True)
    return device_buffer


class BlockTableRows:
    """Block tables of the running requests, one row each, kept on the device and grown in place.

    A request gets a row the first time it is scheduled and keeps it until it leaves the running
    batch (finished, aborted or preempted); blocks are appended to its row as the scheduler
    allocates them. The last row holds only the padding block: padding rows of a batch point there.
    """

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, padding_block: int, device: torch.device) -> None:
        self.padding_row = max_num_seqs
        self.host = _host_buffer((max_num_seqs + 1, max_blocks_per_seq), torch.int32, device)
        self.host[self.padding_row] = padding_block
        self.device_table = _device_twin(self.host, device)
        self.device_table[self.padding_row] = padding_block
        self._host_rows = self.host.numpy()
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self._row_of: dict[str, int] = {}
        self._num_written = [0] * max_num_seqs
        self._dirty_rows: set[int] = set()
        self._device = device
        # Staging for rows on their way to the device (their indices, then their contents).
        self._staged_index = _host_buffer(max_num_seqs, torch.int64, device)
        self._staged_rows = _host_buffer(self.host.shape, torch.int32, device)

    def release(self, request_id: str) -> None:
        row = self._row_of.pop(request_id, None)
        if row is not None:
            self._free_rows.append(row)

    def row_of(self, request: Request) -> int:
        """The request's row, with every block the scheduler has given it written in (on the host)."""
        row = self._row_of.get(request.request_id)
        if row is None:
            row = self._row_of[request.request_id] = self._free_rows.pop()
            self._num_written[row] = 0
        num_written, block_ids = self._num_written[row], request.block_ids
        if len(block_ids) > num_written:
            self._host_rows[row, num_written : len(block_ids)] = block_ids[num_written:]
            self._num_written[row] = len(block_ids)
            self._dirty_rows.add(row)
        return row

    def flush(self) -> None:
        """Copy the rows written since the last flush to the device, in one copy."""
        if self._device.type == "cpu" or not self._dirty_rows:
            self._dirty_rows.clear()
            return
        rows = sorted(self._dirty_rows)
        self._dirty_rows.clear()
        count = len(rows)
        self._staged_index.numpy()[:count] = rows
        torch.index_select(self.host, 0, self._staged_index[:count], out=self._staged_rows[:count])
        index = self._staged_index[:count].to(self._device, non_blocking=True)
        self.device_table.index_copy_(0, index, self._staged_rows[:count].to(self._device, non_blocking=True))


@dataclass(frozen=True)
class PreparedCounts:
    """How much of the host buffers the last `prepare` filled (what a tensor-parallel step message reads)."""

    num_tokens: int = 0
    num_seqs: int = 0
    num_sample_rows: int = 0


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    sample_rows: torch.Tensor  # [num_sampling] int64: each sampling request's last token, in schedule order


class InputBuffers:
    """Host and device buffers for every step's inputs, sized for the largest step."""

    def __init__(
        self, max_num_seqs: int, max_num_tokens: int, max_blocks_per_seq: int, block_size: int, padding_block: int,
        device: torch.device, long_rope: tuple[int, int] | None = None,
    ) -> None:  # fmt: skip
        """`long_rope` (LongRoPE models): (original context, offset of the long rows in the rotary tables); then
        `positions` are rows of those tables, the long ones for the tokens of sequences longer than the original
        context (prompt and output so far, as HF decides it)."""
        self.block_size = block_size
        self.long_rope = long_rope
        self.block_tables = BlockTableRows(max_num_seqs, max_blocks_per_seq, padding_block, device)
        self.host_input_ids = _host_buffer(max_num_tokens, torch.int64, device)
        self.host_query_start_loc = _host_buffer(max_num_seqs + 1, torch.int32, device)
        self.host_seq_lens = _host_buffer(max_num_seqs, torch.int32, device)
        self.host_rows = _host_buffer(max_num_seqs, torch.int64, device)
        self.host_sample_rows = _host_buffer(max_num_seqs, torch.int64, device)
        self.host_sequence_lens = _host_buffer(max_num_seqs, torch.int64, device)
        self.input_ids = _device_twin(self.host_input_ids, device)
        self.query_start_loc = _device_twin(self.host_query_start_loc, device)
        self.seq_lens = _device_twin(self.host_seq_lens, device)
        self.rows = _device_twin(self.host_rows, device)
        self.sample_rows = _device_twin(self.host_sample_rows, device)
        self.sequence_lens = _device_twin(self.host_sequence_lens, device)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.step_block_tables = torch.zeros(max_num_seqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.prepared = PreparedCounts()
        self._token_numbers = torch.arange(max_num_tokens, device=device)
        self._seq_numbers = torch.arange(max_num_seqs, device=device)

    def prepare(self, output: SchedulerOutput, num_padded_seqs: int | None = None) -> StepInputs:
        """The step's inputs; with `num_padded_seqs`, a pure-decode batch padded to that many one-token
        requests at position 0 of the padding block, which they alone read and write (for replayed graphs)."""
        for request_id in output.left_running:
            self.block_tables.release(request_id)
        scheduled = output.scheduled
        num_seqs = len(scheduled)
        padded = num_padded_seqs or num_seqs
        token_ids, query_lens, seq_lens, sample_rows = [], [], [], []
        for item in scheduled:
            token_ids += item.request.token_ids(item.start_position, item.start_position + item.num_new_tokens)
            query_lens.append(item.num_new_tokens)
            seq_lens.append(item.start_position + item.num_new_tokens)
            if item.samples_next_token:
                sample_rows.append(len(token_ids) - 1)
        num_tokens = len(token_ids)
        num_padding = padded - num_seqs
        query_lens += [1] * num_padding
        seq_lens += [1] * num_padding
        total_tokens = num_tokens + num_padding

        self.host_input_ids.numpy()[:total_tokens] = token_ids + [0] * num_padding
        query_start_loc = self.host_query_start_loc.numpy()
        query_start_loc[0] = 0
        np.cumsum(query_lens, out=query_start_loc[1 : padded + 1])
        self.host_seq_lens.numpy()[:padded] = seq_lens
        rows = [self.block_tables.row_of(item.request) for item in scheduled]
        self.host_rows.numpy()[:padded] = rows + [self.block_tables.padding_row] * num_padding
        self.host_sample_rows.numpy()[: len(sample_rows)] = sample_rows
        self.block_tables.flush()
        copies = [
            (self.host_input_ids, self.input_ids, total_tokens),
            (self.host_query_start_loc, self.query_start_loc, padded + 1),
            (self.host_seq_lens, self.seq_lens, padded),
            (self.host_rows, self.rows, padded),
            (self.host_sample_rows, self.sample_rows, len(sample_rows)),
        ]
        if self.long_rope is not None:
            sequence_lens = [item.request.num_tokens for item in scheduled]
            self.host_sequence_lens.numpy()[:padded] = sequence_lens + [1] * num_padding
            copies.append((self.host_sequence_lens, self.sequence_lens, padded))
        for host, device_buffer, count in copies:
            _to_device(host[:count], device_buffer[:count])

        self._derive_positions_and_slots(total_tokens, padded)
        self.prepared = PreparedCounts(total_tokens, padded, len(sample_rows))
        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping[:total_tokens],
            query_start_loc=self.query_start_loc[: padded + 1],
            seq_lens=self.seq_lens[:padded],
            block_tables=self.step_block_tables[:padded],
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        return StepInputs(
            self.input_ids[:total_tokens], self.positions[:total_tokens], metadata, self.sample_rows[: len(sample_rows)]
        )

    def _derive_positions_and_slots(self, total_tokens: int, num_seqs: int) -> None:
        """On the device: the step's block tables by batch order, then each token's position and cache slot."""
        block_tables = self.step_block_tables[:num_seqs]
        torch.index_select(self.block_tables.device_table, 0, self.rows[:num_seqs], out=block_tables)
        sequence_lens = self.sequence_lens[:num_seqs] if self.long_rope is not None else None
        positions, slot_mapping = positions_and_slots(
            self.query_start_loc[: num_seqs + 1], self.seq_lens[:num_seqs], block_tables, self.block_size,
            self._token_numbers[:total_tokens], self._seq_numbers[:num_seqs], self.long_rope, sequence_lens,
        )  # fmt: skip
        self.positions[:total_tokens] = positions
        self.slot_mapping[:total_tokens] = slot_mapping


def positions_and_slots(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int,
    token_numbers: torch.Tensor, seq_numbers: torch.Tensor, long_rope: tuple[int, int] | None = None,
    sequence_lens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Each packed token's position (a row of the rotary tables: LongRoPE's long rows for sequences past the
    original context) and its cache slot, on the tensors' device. `token_numbers` and `seq_numbers` are
    arange(num_tokens) and arange(num_seqs): the step path passes views of buffers it allocated once."""
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    seq_index = torch.repeat_interleave(seq_numbers, query_lens, output_size=token_numbers.shape[0])
    first_positions = (seq_lens - query_lens)[seq_index]
    positions = token_numbers - query_start_loc[:-1][seq_index] + first_positions
    block_ids = block_tables[seq_index, positions // block_size].long()
    slot_mapping = block_ids * block_size + positions % block_size
    if long_rope is not None:
        original_len, long_rows = long_rope
        positions = positions + long_rows * (sequence_lens[seq_index] > original_len)
    return positions, slot_mapping
