"""A step's plan: everything a rank needs to run one forward, as plain host arrays, built from the scheduler's
output on rank 0 (`StepPlanner`) and run the same way by every rank (`Worker.execute`).

It holds the packed token ids, each sequence's query and context lengths, its block-table row and (when the engine
serves LoRA adapters) its adapter slot, the rows whose logits the step computes, and the block-table entries written
since the last step (so each rank keeps its own copy of the block tables without ever receiving them whole). With
tensor parallelism rank 0 broadcasts it to the others (`send` / `receive`: one fixed-size header, then one int64
payload), O(tokens + sequences + new blocks), never the scheduler's state.
"""

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.engine.parallel.group import TensorParallelGroup
from kvserve.scheduler import Request, SchedulerOutput

# running, tokens, sequences, logit rows, table entries, has sequence lengths, graph size, has adapter slots
_HEADER_SIZE = 8


@dataclass(frozen=True)
class StepPlan:
    input_ids: np.ndarray  # [num_tokens] int64
    query_lens: np.ndarray  # [num_seqs] int64: new tokens of each sequence (padding sequences: 1)
    seq_lens: np.ndarray  # [num_seqs] int64: context length including the new tokens
    rows: np.ndarray  # [num_seqs] int64: each sequence's block-table row (padding sequences: the padding row)
    logit_rows: np.ndarray  # [num_logit_rows] int64: token rows whose logits the step returns, in that order
    table_entries: np.ndarray  # [3, num_entries] int64: (row, column, block id) written since the last step
    sequence_lens: np.ndarray | None  # [num_seqs] int64: LongRoPE models only, each sequence's whole length
    graph_size: int = 0  # a padded pure-decode batch replays the graph of this size; 0: run eagerly
    lora_slots: np.ndarray | None = None  # [num_seqs] int64: each sequence's adapter slot, -1 for the base model

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @classmethod
    def in_padding_block(
        cls, query_lens: list[int], seq_lens: list[int], padding_row: int, long_rope: bool,
        logit_rows: tuple[int, ...] = (),
    ) -> "StepPlan":  # fmt: skip
        """Sequences in the padding row, which only the padding block fills (so none may be longer than a block):
        what they write no request reads. A graph's capture, and the warm-up, run such steps."""
        num_seqs = len(seq_lens)
        return cls(
            input_ids=np.zeros(sum(query_lens), dtype=np.int64), query_lens=np.array(query_lens, dtype=np.int64),
            seq_lens=np.array(seq_lens, dtype=np.int64), rows=np.full(num_seqs, padding_row, dtype=np.int64),
            logit_rows=np.array(logit_rows, dtype=np.int64), table_entries=np.zeros((3, 0), dtype=np.int64),
            sequence_lens=np.array(seq_lens, dtype=np.int64) if long_rope else None,
        )  # fmt: skip

    @property
    def nbytes(self) -> int:
        """What `send` broadcasts."""
        parts = (self.input_ids, self.query_lens, self.seq_lens, self.rows, self.logit_rows, self.table_entries)
        optional = sum(len(part) for part in (self.sequence_lens, self.lora_slots) if part is not None)
        return 8 * (_HEADER_SIZE + sum(part.size for part in parts) + optional)

    def send(self, group: TensorParallelGroup) -> None:
        """Rank 0: broadcast this plan to the other ranks."""
        header = [1, self.num_tokens, self.num_seqs, len(self.logit_rows), self.table_entries.shape[1],
                  int(self.sequence_lens is not None), self.graph_size, int(self.lora_slots is not None)]  # fmt: skip
        group.broadcast_from_first(torch.tensor(header, dtype=torch.int64), announces_step=True)
        parts = [self.input_ids, self.query_lens, self.seq_lens, self.rows, self.logit_rows,
                 self.table_entries.reshape(-1)]  # fmt: skip
        parts += [part for part in (self.sequence_lens, self.lora_slots) if part is not None]
        group.broadcast_from_first(torch.from_numpy(np.concatenate(parts)))

    @classmethod
    def receive(cls, group: TensorParallelGroup) -> "StepPlan | None":
        """The other ranks: the next plan, or None when rank 0 says stop (`send_stop`)."""
        header = group.broadcast_from_first(torch.zeros(_HEADER_SIZE, dtype=torch.int64), announces_step=True)
        running, num_tokens, num_seqs, num_logit_rows, num_entries, has_sequence_lens, graph_size, has_lora_slots = (
            header.tolist()
        )
        if not running:
            return None
        sizes = [num_tokens, num_seqs, num_seqs, num_seqs, num_logit_rows, 3 * num_entries]
        sizes += [num_seqs] * (has_sequence_lens + has_lora_slots)
        payload = group.broadcast_from_first(torch.empty(sum(sizes), dtype=torch.int64)).numpy()
        parts = np.split(payload, np.cumsum(sizes)[:-1])
        optional = iter(parts[6:])
        return cls(
            input_ids=parts[0], query_lens=parts[1], seq_lens=parts[2], rows=parts[3], logit_rows=parts[4],
            table_entries=parts[5].reshape(3, num_entries), sequence_lens=next(optional) if has_sequence_lens else None,
            graph_size=graph_size, lora_slots=next(optional) if has_lora_slots else None,
        )  # fmt: skip


def send_stop(group: TensorParallelGroup) -> None:
    """Rank 0: tell the other ranks to leave their loop."""
    group.broadcast_from_first(torch.zeros(_HEADER_SIZE, dtype=torch.int64), announces_step=True)


class BlockTableRows:
    """Which block-table row each running request holds, and how many of its blocks the tables already have: the
    (row, column, block id) entries a plan carries are the blocks given since.

    A request gets a row the first time it is planned and keeps it until it leaves the running batch (finished,
    aborted or preempted: `release`); blocks are appended to its row as the scheduler allocates them. The last row,
    `padding_row`, holds only the padding block: padding sequences of a batch point there.
    """

    def __init__(self, max_num_seqs: int) -> None:
        self.padding_row = max_num_seqs
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self._row_of: dict[str, int] = {}
        self._num_written = [0] * max_num_seqs

    def release(self, request_ids: list[str]) -> None:
        """These requests left the running batch: their rows are free (requests without one are passed over)."""
        for request_id in request_ids:
            row = self._row_of.pop(request_id, None)
            if row is not None:
                self._free_rows.append(row)

    def row(self, request: Request, entry_rows: list, entry_columns: list, entry_blocks: list) -> int:
        """The request's row, with the blocks the scheduler gave it since it was last planned added to the entries."""
        row = self._row_of.get(request.request_id)
        block_ids = request.block_ids
        if row is not None and self._num_written[row] == len(block_ids):  # the common case: nothing new
            return row
        if row is None:
            row = self._row_of[request.request_id] = self._free_rows.pop()
            self._num_written[row] = 0
        num_written = self._num_written[row]
        if len(block_ids) > num_written:
            new_blocks = block_ids[num_written:]
            entry_rows += [row] * len(new_blocks)
            entry_columns += range(num_written, len(block_ids))
            entry_blocks += new_blocks
            self._num_written[row] = len(block_ids)
        return row


class StepPlanner:
    """Rank 0: turns the scheduler's output into a `StepPlan`, keeping which block-table row each running request
    holds (`BlockTableRows`)."""

    def __init__(self, max_num_seqs: int, long_rope: bool) -> None:
        self.table_rows = BlockTableRows(max_num_seqs)
        self.padding_row = self.table_rows.padding_row
        self.long_rope = long_rope

    def plan(
        self, output: SchedulerOutput, extra_logit_rows: list[int] | None = None, graph_size: int = 0,
        lora_slots: list[int] | None = None,
    ) -> StepPlan:  # fmt: skip
        """The step's plan: the scheduled requests' tokens, then (to `graph_size`) padding sequences; the logits
        of each request that samples, in schedule order (a request with draft tokens: of its last token and of each
        draft), then of `extra_logit_rows` (rows of the step's tokens). In a step that replays a graph, a request
        with drafts is one decode sequence per token (the same tokens, positions and cache slots; each attends to
        its context up to its own position), so that the step is a pure decode of the graph's size.
        `lora_slots`: each scheduled request's adapter slot (-1: the base model), when the engine serves adapters."""
        table_rows = self.table_rows
        table_rows.release(output.left_running)
        token_ids, query_lens, seq_lens, rows, sample_rows = [], [], [], [], []
        entry_rows, entry_columns, entry_blocks = [], [], []
        sequences_per_item = []  # 1, or a verifying decode's tokens in a graph's step (each a decode of its own)
        for item in output.scheduled:
            request, start, num_new_tokens = item.request, item.start_position, item.num_new_tokens
            end = start + num_new_tokens
            output_start = start - len(request.prompt_token_ids)
            if num_new_tokens == 1 and output_start >= 0:  # a decode: its last sampled token
                token_ids.append(request.output_token_ids[output_start])
            elif item.num_draft_tokens:  # a decode and its drafts after it
                token_ids += request.token_ids(start, start + 1)
                token_ids += request.draft_token_ids[: item.num_draft_tokens]
            else:
                token_ids += request.token_ids(start, end)
            row = table_rows.row(request, entry_rows, entry_columns, entry_blocks)
            if graph_size and item.num_draft_tokens:  # each token a decode, its context up to its own position
                query_lens += [1] * num_new_tokens
                seq_lens += range(start + 1, end + 1)
                rows += [row] * num_new_tokens
                sequences_per_item.append(num_new_tokens)
            else:
                query_lens.append(num_new_tokens)
                seq_lens.append(end)
                rows.append(row)
                sequences_per_item.append(1)
            if item.num_draft_tokens:  # every row: each checks the draft after it, the last gives one more token
                sample_rows += range(len(token_ids) - 1 - item.num_draft_tokens, len(token_ids))
            elif item.samples_next_token:
                sample_rows.append(len(token_ids) - 1)
        num_padding = graph_size - len(rows) if graph_size else 0
        sequence_lens = None
        if self.long_rope:
            whole_lens = np.repeat([item.request.num_tokens for item in output.scheduled], sequences_per_item)
            sequence_lens = np.concatenate([whole_lens, np.ones(num_padding, dtype=np.int64)]).astype(np.int64)
        return StepPlan(
            input_ids=np.array(token_ids + [0] * num_padding, dtype=np.int64),
            query_lens=np.array(query_lens + [1] * num_padding, dtype=np.int64),
            seq_lens=np.array(seq_lens + [1] * num_padding, dtype=np.int64),
            rows=np.array(rows + [self.padding_row] * num_padding, dtype=np.int64),
            logit_rows=np.array(sample_rows + (extra_logit_rows or []), dtype=np.int64),
            table_entries=np.array([entry_rows, entry_columns, entry_blocks], dtype=np.int64).reshape(3, -1),
            sequence_lens=sequence_lens,
            graph_size=graph_size,
            lora_slots=None
            if lora_slots is None
            else np.concatenate([np.repeat(lora_slots, sequences_per_item), np.full(num_padding, -1)]).astype(np.int64),
        )
