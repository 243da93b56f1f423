"""A step's model inputs, written from its `StepPlan` into buffers allocated once, with no wait on the device: the
one place attention metadata is built, the same on every rank.

The host side of each step is O(new tokens + sequences + new blocks): token ids, query and context lengths and
block-table row numbers are copied from the plan into host buffers (pinned on CUDA) and on to their device twins
asynchronously; positions and slot mappings are derived on the device. Block tables live on the device, one row
per running request, and only the entries the plan adds are written into them (`BlockTables`).

Host buffers are rewritten only after the previous step's results came back, i.e. after the device finished
reading them; the sampler's one transfer back per step is that wait.
"""

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.engine.step_plan import StepPlan
from kvserve.kernels import AttentionMetadata
from kvserve.kernels.lora import LoraBatch


def _host_buffer(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, pin_memory=device.type == "cuda")


def _device_twin(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The device buffer a host buffer is copied into; the host buffer itself when the device is the CPU."""
    return host if device.type == "cpu" else torch.zeros(host.shape, dtype=host.dtype, device=device)


def _to_device(host: torch.Tensor, device_buffer: torch.Tensor) -> None:
    if device_buffer.data_ptr() != host.data_ptr():
        device_buffer.copy_(host, non_blocking=True)


class BlockTables:
    """This rank's block tables: row r holds the block ids of the request `StepPlanner` gave row r, kept on the
    device and grown in place; the last row holds only the padding block."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, padding_block: int, device: torch.device) -> None:
        self.padding_row = max_num_seqs
        self.host = _host_buffer((max_num_seqs + 1, max_blocks_per_seq), torch.int32, device)
        self.host[self.padding_row] = padding_block
        self.device_table = _device_twin(self.host, device)
        self.device_table[self.padding_row] = padding_block
        self._host_rows = self.host.numpy()
        self._device = device
        # Staging for rows on their way to the device (their indices, then their contents).
        self._staged_index = _host_buffer(max_num_seqs, torch.int64, device)
        self._staged_rows = _host_buffer(self.host.shape, torch.int32, device)

    def write(self, entries: np.ndarray) -> None:
        """Write (row, column, block id) entries, and copy the rows they touch to the device in one copy."""
        if not entries.shape[1]:
            return
        rows, columns, block_ids = entries
        self._host_rows[rows, columns] = block_ids
        if self._device.type == "cpu":
            return
        changed = np.unique(rows)
        count = len(changed)
        self._staged_index.numpy()[:count] = changed
        torch.index_select(self.host, 0, self._staged_index[:count], out=self._staged_rows[:count])
        index = self._staged_index[:count].to(self._device, non_blocking=True)
        self.device_table.index_copy_(0, index, self._staged_rows[:count].to(self._device, non_blocking=True))


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    logit_rows: torch.Tensor  # [num_logit_rows] int64: the token rows whose logits the step returns


class InputBuffers:
    """Host and device buffers for every step's inputs, sized for the largest step."""

    def __init__(
        self, max_num_seqs: int, max_num_tokens: int, max_blocks_per_seq: int, block_size: int, padding_block: int,
        device: torch.device, long_rope: tuple[int, int] | None = None, max_num_logit_rows: int | None = None,
        lora: LoraBatch | None = None,
    ) -> None:  # fmt: skip
        """`long_rope` (LongRoPE models): (original context, offset of the long rows in the rotary tables); then
        `positions` are rows of those tables, the long ones for the tokens of sequences longer than the original
        context (prompt and output so far, as HF decides it). `max_num_logit_rows`: the most rows a step returns
        logits for (sampling requests and prompt tokens being scored); by default every token. `lora`: the batch
        the model's adapter layers read, when the engine serves adapters: each token's slot, from the plan's."""
        self.block_size = block_size
        self.lora = lora
        self.long_rope = long_rope
        self.device = device
        self.block_tables = BlockTables(max_num_seqs, max_blocks_per_seq, padding_block, device)
        self.host_input_ids = _host_buffer(max_num_tokens, torch.int64, device)
        self.host_query_start_loc = _host_buffer(max_num_seqs + 1, torch.int32, device)
        self.host_seq_lens = _host_buffer(max_num_seqs, torch.int32, device)
        self.host_rows = _host_buffer(max_num_seqs, torch.int64, device)
        self.host_logit_rows = _host_buffer(max_num_logit_rows or max_num_tokens, torch.int64, device)
        self.host_sequence_lens = _host_buffer(max_num_seqs, torch.int64, device)
        self.input_ids = _device_twin(self.host_input_ids, device)
        self.query_start_loc = _device_twin(self.host_query_start_loc, device)
        self.seq_lens = _device_twin(self.host_seq_lens, device)
        self.rows = _device_twin(self.host_rows, device)
        self.logit_rows = _device_twin(self.host_logit_rows, device)
        self.sequence_lens = _device_twin(self.host_sequence_lens, device)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.step_block_tables = torch.zeros(max_num_seqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self._token_numbers = torch.arange(max_num_tokens, device=device)
        self._seq_numbers = torch.arange(max_num_seqs, device=device)

    def prepare(self, plan: StepPlan) -> StepInputs:
        """The step's inputs on the device, laid out as the plan says."""
        self.block_tables.write(plan.table_entries)
        num_tokens, num_seqs, num_logit_rows = plan.num_tokens, plan.num_seqs, len(plan.logit_rows)
        self.host_input_ids.numpy()[:num_tokens] = plan.input_ids
        query_start_loc = self.host_query_start_loc.numpy()
        query_start_loc[0] = 0
        np.cumsum(plan.query_lens, out=query_start_loc[1 : num_seqs + 1])
        self.host_seq_lens.numpy()[:num_seqs] = plan.seq_lens
        self.host_rows.numpy()[:num_seqs] = plan.rows
        self.host_logit_rows.numpy()[:num_logit_rows] = plan.logit_rows
        copies = [
            (self.host_input_ids, self.input_ids, num_tokens),
            (self.host_query_start_loc, self.query_start_loc, num_seqs + 1),
            (self.host_seq_lens, self.seq_lens, num_seqs),
            (self.host_rows, self.rows, num_seqs),
            (self.host_logit_rows, self.logit_rows, num_logit_rows),
        ]
        if self.long_rope is not None:
            self.host_sequence_lens.numpy()[:num_seqs] = plan.sequence_lens
            copies.append((self.host_sequence_lens, self.sequence_lens, num_seqs))
        for host, device_buffer, count in copies:
            _to_device(host[:count], device_buffer[:count])

        if self.lora is not None:
            self._set_lora_slots(plan)
        if self.device.type == "cpu":
            self._derive_positions_and_slots_on_host(plan)
        else:
            self._derive_positions_and_slots(num_tokens, num_seqs)
        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens],
            query_start_loc=self.query_start_loc[: num_seqs + 1],
            seq_lens=self.seq_lens[:num_seqs],
            block_tables=self.step_block_tables[:num_seqs],
            query_lens_cpu=plan.query_lens.tolist(),
            seq_lens_cpu=plan.seq_lens.tolist(),
        )
        return StepInputs(
            self.input_ids[:num_tokens], self.positions[:num_tokens], metadata, self.logit_rows[:num_logit_rows]
        )

    def _set_lora_slots(self, plan: StepPlan) -> None:
        """Each token's adapter slot (a plan without slots: the warm-up's, all base model); a graph's step launches
        the LoRA kernels with the tile count its graph was captured with."""
        if plan.lora_slots is None:
            token_slots = np.full(plan.num_tokens, -1, dtype=np.int64)
        else:
            token_slots = np.repeat(plan.lora_slots, plan.query_lens)
        fixed_num_tiles = self.lora.tiles_for(plan.num_tokens) if plan.graph_size else None
        num_decodes = int(np.argmax(plan.query_lens != 1)) if (plan.query_lens != 1).any() else plan.num_seqs
        self.lora.set(token_slots, fixed_num_tiles, num_decode_rows=num_decodes)

    def _derive_positions_and_slots(self, num_tokens: int, num_seqs: int) -> None:
        """On the device: the step's block tables by batch order, then each token's position and cache slot."""
        block_tables = self.step_block_tables[:num_seqs]
        torch.index_select(self.block_tables.device_table, 0, self.rows[:num_seqs], out=block_tables)
        sequence_lens = self.sequence_lens[:num_seqs] if self.long_rope is not None else None
        positions, slot_mapping = positions_and_slots(
            self.query_start_loc[: num_seqs + 1], self.seq_lens[:num_seqs], block_tables, self.block_size,
            self._token_numbers[:num_tokens], self._seq_numbers[:num_seqs], self.long_rope, sequence_lens,
        )  # fmt: skip
        self.positions[:num_tokens] = positions
        self.slot_mapping[:num_tokens] = slot_mapping

    def _derive_positions_and_slots_on_host(self, plan: StepPlan) -> None:
        """`_derive_positions_and_slots` when the device is the CPU, in NumPy on the buffers themselves: a dozen
        small torch ops cost 0.2 ms a step for 256 decodes on the 2-core machine here, these about 0.03 ms."""
        num_tokens, num_seqs = plan.num_tokens, plan.num_seqs
        block_tables = self.step_block_tables[:num_seqs].numpy()
        # Only the columns the longest sequence uses: kernels read no block past a sequence's length.
        num_columns = -(-int(plan.seq_lens.max()) // self.block_size) if num_seqs else 0
        block_tables[:, :num_columns] = self.block_tables.host.numpy()[plan.rows, :num_columns]
        sequence_lens = None if self.long_rope is None else plan.sequence_lens
        positions, slot_mapping = host_positions_and_slots(
            plan.query_lens, plan.seq_lens, block_tables, self.block_size, self.long_rope, sequence_lens
        )
        self.positions[:num_tokens].numpy()[:] = positions
        self.slot_mapping[:num_tokens].numpy()[:] = slot_mapping


def host_positions_and_slots(
    query_lens: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray, block_size: int,
    long_rope: tuple[int, int] | None = None, sequence_lens: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """`positions_and_slots` in NumPy, from the plan's lengths (its test holds the two equal)."""
    seq_index = np.repeat(np.arange(len(seq_lens)), query_lens)
    query_starts = np.cumsum(query_lens) - query_lens
    positions = np.arange(len(seq_index)) - query_starts[seq_index] + (seq_lens - query_lens)[seq_index]
    slot_mapping = block_tables[seq_index, positions // block_size].astype(np.int64) * block_size
    slot_mapping += positions % block_size
    if long_rope is not None:
        original_len, long_rows = long_rope
        positions = positions + long_rows * (sequence_lens[seq_index] > original_len)
    return positions, slot_mapping


def positions_and_slots(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int,
    token_numbers: torch.Tensor, seq_numbers: torch.Tensor, long_rope: tuple[int, int] | None = None,
    sequence_lens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Each packed token's position (a row of the rotary tables: LongRoPE's long rows for sequences past the
    original context) and its cache slot, on the tensors' device. `token_numbers` and `seq_numbers` are
    arange(num_tokens) and arange(num_seqs): views of buffers allocated once."""
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
