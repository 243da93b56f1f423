"""Draft-model proposals: a smaller model with the target's vocabulary proposes each decoding request's drafts,
greedily, in one forward per draft position for all the step's requests together.

The draft keeps its own paged KV cache in the target's blocks: its cache tensors have as many blocks as the
target's, and it reads the block tables the scheduler keeps, so its memory is allocated, shared through the prefix
cache, preempted and freed with the target's, and it has no allocator of its own to keep in step. Its cache is
filled lazily: a request's draft KV holds the tokens the draft last ran for it, as far as the request still agrees
with them (the tokens before its drafts, then the drafts verification accepted). When the request next gets drafts,
one forward runs the tokens after those (its whole prompt the first time, one or two tokens after a verifying step)
and the row of its last token gives the first draft; each further forward runs the draft before. A request that
left the running batch (finished or preempted: its blocks are gone) starts again from its first token.

Proposals are greedy, so each is certain given the request's text, and verification's rule for certain drafts
keeps a sampled output's distribution the target's (engine/speculative/verification.py). A request with structured
outputs is proposed under its grammar (a copy that consumes the drafts): a draft the grammar refuses could never be
accepted.
"""

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvserve.engine.config import EngineConfig
from kvserve.engine.kv_sizing import StepLimits
from kvserve.engine.model_loader import checkpoint_dtype, load_model, prepare_weights
from kvserve.engine.models import DecoderForCausalLM
from kvserve.engine.step_plan import BlockTableRows, StepPlan
from kvserve.engine.structured_output import TokenMasks
from kvserve.engine.worker import Worker
from kvserve.kernels import AttentionShape, select_backend
from kvserve.kvcache import KVCache, KVCacheSpec
from kvserve.scheduler import Request, ScheduledRequest

if TYPE_CHECKING:
    import llguidance

logger = logging.getLogger(__name__)
UNPROPOSED = -1  # a draft slot reserved before scheduling, until the draft model fills it once the step is known


@dataclass
class _DraftKV:
    """What a request's draft KV holds: its first `num_tokens` tokens, then the drafts run after them."""

    num_tokens: int
    drafts: list[int]

    def num_valid(self, token_ids: list[int]) -> int:
        """How many of `token_ids` (the request's tokens now) the draft KV holds."""
        num_valid = self.num_tokens
        for draft, token_id in zip(self.drafts, token_ids[self.num_tokens :], strict=False):
            if draft != token_id:
                break
            num_valid += 1
        return num_valid


@dataclass(frozen=True)
class _Segment:
    """Tokens of one request run in a draft forward, ending at `seq_len`; `proposes`: its last row's choice is kept."""

    request: Request
    token_ids: list[int]
    seq_len: int
    proposes: bool


def load_draft_model(config: EngineConfig, draft_dir: Path, device: torch.device) -> DecoderForCausalLM:
    return load_model(draft_dir, config.torch_dtype(device, checkpoint_dtype(draft_dir)), device)


def draft_kv_spec(config: EngineConfig, draft: DecoderForCausalLM) -> KVCacheSpec:
    return KVCacheSpec(
        num_layers=draft.config.num_layers, num_kv_heads=draft.plan.num_kv_heads, head_dim=draft.config.head_dim,
        dtype=config.torch_kv_cache_dtype(next(draft.parameters()).dtype), block_size=config.block_size,
    )  # fmt: skip


class DraftModel:
    def __init__(self, worker: Worker, max_num_seqs: int, max_num_tokens: int) -> None:
        self.worker = worker
        self.table_rows = BlockTableRows(max_num_seqs)
        self.max_num_tokens = max_num_tokens  # a forward's tokens: its input buffers' size
        self._kv: dict[str, _DraftKV] = {}

    @classmethod
    def build(
        cls, draft: DecoderForCausalLM, config: EngineConfig, target: DecoderForCausalLM, num_blocks: int,
        limits: StepLimits, device: torch.device,
    ) -> "DraftModel":  # fmt: skip
        """The draft beside a target whose cache has `num_blocks` blocks: a cache of as many, kernels ready."""
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"speculative_config.model: the draft's vocabulary ({draft.config.vocab_size} tokens) is not the "
                f"target's ({target.config.vocab_size}): a draft must share the target's tokenizer"
            )
        if draft.config.max_position_embeddings < limits.max_model_len:
            raise ValueError(
                f"speculative_config.model: the draft's context ({draft.config.max_position_embeddings} tokens) is "
                f"shorter than max_model_len ({limits.max_model_len})"
            )
        shape = AttentionShape(config.max_num_seqs, draft.plan.num_heads, draft.config.head_dim)
        backend = select_backend(config.attention_backend, device, shape)
        prepare_weights(draft, backend)
        kv_cache = KVCache.allocate(draft_kv_spec(config, draft), num_blocks, device)
        worker = Worker(draft, kv_cache, backend, limits, config.max_num_seqs, device)
        if device.type == "cuda":
            worker.warm_up()
        logger.info(
            "draft model: %s, %d layers (%.2fM parameters); its KV cache in the target's %d blocks: %.1f MiB",
            type(draft).__name__, draft.config.num_layers, sum(p.numel() for p in draft.parameters()) / 1e6,
            num_blocks, kv_cache.total_bytes / 2**20,
        )  # fmt: skip
        return cls(worker, config.max_num_seqs, worker.inputs.host_input_ids.shape[0])

    def release(self, request_ids: list[str]) -> None:
        """These requests left the running batch: their blocks, and so their draft KV, are gone."""
        self.table_rows.release(request_ids)
        for request_id in request_ids:
            self._kv.pop(request_id, None)

    @torch.inference_mode()
    def propose(
        self, scheduled: list[ScheduledRequest], grammars: "dict[str, llguidance.LLMatcher] | None" = None,
        token_masks: TokenMasks | None = None,
    ) -> None:  # fmt: skip
        """Set the drafts of every scheduled request that verifies some (`num_draft_tokens` of them): the draft
        model's greedy continuation of its tokens. The scheduler has given the blocks of their positions.
        `grammars`: the matchers of requests with structured outputs (by request id; left as they are), whose drafts
        `token_masks` confines to what the grammar allows."""
        items = [item for item in scheduled if item.num_draft_tokens]
        if not items:
            return
        grammars_ahead = {request_id: grammar.deep_copy() for request_id, grammar in (grammars or {}).items()}
        requests = [item.request for item in items]
        drafts = [[token_id] for token_id in self._first_drafts(requests, grammars_ahead, token_masks)]
        for ahead in range(1, max(item.num_draft_tokens for item in items)):
            wanting = [index for index, item in enumerate(items) if item.num_draft_tokens > ahead]
            segments = [
                _Segment(requests[index], [drafts[index][-1]], requests[index].num_tokens + ahead, proposes=True)
                for index in wanting
            ]
            for index, token_id in zip(wanting, self._next_tokens(segments, grammars_ahead, token_masks), strict=True):
                drafts[index].append(token_id)
        for request, request_drafts in zip(requests, drafts, strict=True):
            request.draft_token_ids = request_drafts
            # The last draft was proposed, never run: the cache holds the ones before it.
            self._kv[request.request_id] = _DraftKV(request.num_tokens, request_drafts[:-1])

    def _first_drafts(
        self, requests: list[Request], grammars_ahead: "dict[str, llguidance.LLMatcher]", token_masks: TokenMasks | None
    ) -> list[int]:
        """Run each request's tokens its draft KV lacks, in forwards of at most `max_num_tokens` tokens (a request's
        may span several); the first draft of each, from its last token's row."""
        pending = []
        for request in requests:
            token_ids = request.prompt_token_ids + request.output_token_ids
            kv = self._kv.get(request.request_id)
            # Its last token is never in the draft KV: it was sampled after the drafts the KV holds.
            pending.append((request, token_ids, min(kv.num_valid(token_ids), len(token_ids) - 1) if kv else 0))
        first_drafts: dict[str, int] = {}
        while pending:
            segments, left, budget = [], [], self.max_num_tokens
            for request, token_ids, start in pending:
                count = min(len(token_ids) - start, budget)
                if count:
                    end = start + count
                    segments.append(_Segment(request, token_ids[start:end], end, proposes=end == len(token_ids)))
                    budget -= count
                if start + count < len(token_ids):
                    left.append((request, token_ids, start + count))
            proposing = [segment.request.request_id for segment in segments if segment.proposes]
            first_drafts.update(zip(proposing, self._next_tokens(segments, grammars_ahead, token_masks), strict=True))
            pending = left
        return [first_drafts[request.request_id] for request in requests]

    def _next_tokens(
        self,
        segments: list[_Segment],
        grammars_ahead: "dict[str, llguidance.LLMatcher]",
        token_masks: TokenMasks | None,
    ) -> list[int]:
        """Run the segments in one draft forward; the greedy next token of each that proposes, in order (under its
        grammar, which then consumes it, for a request in `grammars_ahead`)."""
        logits = self._forward(segments)
        proposing = [segment.request.request_id for segment in segments if segment.proposes]
        constrained = [row for row, request_id in enumerate(proposing) if request_id in grammars_ahead]
        if constrained:
            logits = token_masks.apply(logits, constrained, [grammars_ahead[proposing[row]] for row in constrained])
        token_ids = logits.argmax(dim=-1).tolist()
        for row in constrained:
            grammars_ahead[proposing[row]].consume_token(token_ids[row])
        return token_ids

    def _forward(self, segments: list[_Segment]) -> torch.Tensor:
        """Run the segments in one draft forward; the logits of the last row of each that proposes, in order."""
        entry_rows, entry_columns, entry_blocks = [], [], []
        rows = [self.table_rows.row(s.request, entry_rows, entry_columns, entry_blocks) for s in segments]
        query_lens = np.array([len(segment.token_ids) for segment in segments], dtype=np.int64)
        ends = np.cumsum(query_lens)
        plan = StepPlan(
            input_ids=np.array([t for segment in segments for t in segment.token_ids], dtype=np.int64),
            query_lens=query_lens, seq_lens=np.array([segment.seq_len for segment in segments], dtype=np.int64),
            rows=np.array(rows, dtype=np.int64),
            logit_rows=np.array([end - 1 for end, s in zip(ends, segments, strict=True) if s.proposes], dtype=np.int64),
            table_entries=np.array([entry_rows, entry_columns, entry_blocks], dtype=np.int64).reshape(3, -1),
            sequence_lens=None,
        )  # fmt: skip
        if not len(plan.logit_rows):
            self.worker.forward(self.worker.inputs.prepare(plan))
            return torch.empty(0, self.worker.model.config.vocab_size)
        return self.worker.execute(plan)
