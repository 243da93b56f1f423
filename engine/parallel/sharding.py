"""Which slice of each weight a tensor-parallel rank holds (Megatron-style), as plain arithmetic.

Attention heads are split across ranks: q/k/v are column-parallel (each rank projects to its own heads) and
o_proj is row-parallel (each rank's heads' share of the output, summed by one all-reduce). gate/up are
column-parallel and down_proj row-parallel the same way, in every expert of a mixture-of-experts block too
(each rank holds a slice of every expert, so routing needs no exchange of tokens). The embedding and the LM
head are split by vocabulary rows, padded to a multiple of the ranks. KV heads are split too; with fewer KV
heads than ranks each is replicated on the ranks whose query heads use it (8 KV heads at 16 ranks: each on two).
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the decoder builds its layers from a plan: a runtime import would be circular
    from kvserve.engine.models.decoder import DecoderConfig


class TensorParallelError(ValueError):
    """The model cannot be split over this many ranks (or the setup asked for is not possible)."""


@dataclass(frozen=True)
class Slice:
    """Rows (dim 0) or columns (dim 1) [start, start + length) of a checkpoint tensor."""

    dim: int
    start: int
    length: int


@dataclass(frozen=True)
class ShardPlan:
    """Rank `rank` of `size`'s part of a decoder with `config`; rank 0 of 1 holds everything."""

    config: "DecoderConfig"
    rank: int = 0
    size: int = 1

    @classmethod
    def of(cls, config: "DecoderConfig", rank: int, size: int) -> "ShardPlan":
        """The plan, or `TensorParallelError` naming what does not divide (checked before any rank starts)."""
        if size < 1 or not 0 <= rank < size:
            raise TensorParallelError(f"rank {rank} of {size} ranks")
        if size > 1:
            cls._check_divides(config, size)
        return cls(config, rank, size)

    @staticmethod
    def _check_divides(config: "DecoderConfig", size: int) -> None:
        problems = []
        if config.num_heads % size:
            problems.append(f"{config.num_heads} attention heads")
        kv_heads = config.num_kv_heads
        if (kv_heads >= size and kv_heads % size) or (kv_heads < size and size % kv_heads):
            problems.append(f"{kv_heads} KV heads (nor do they divide it)")
        moe = config.moe
        if (moe is None or len(moe.sparse_layers) < config.num_layers) and config.intermediate_size % size:
            problems.append(f"an intermediate size of {config.intermediate_size}")
        if moe is not None and moe.intermediate_size % size:
            problems.append(f"an expert intermediate size of {moe.intermediate_size}")
        if moe is not None and moe.shared_expert_intermediate_size % size:
            problems.append(f"a shared expert intermediate size of {moe.shared_expert_intermediate_size}")
        if problems:
            raise TensorParallelError(
                f"tensor_parallel_size {size} does not divide {' or '.join(problems)} of this model"
            )

    @property
    def num_heads(self) -> int:
        return self.config.num_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.config.num_kv_heads // self.size)

    @property
    def first_kv_head(self) -> int:
        """The first KV head this rank holds: its query heads' (replicated ones are shared by several ranks)."""
        query_heads_per_kv_head = self.config.num_heads // self.config.num_kv_heads
        return self.rank * self.num_heads // query_heads_per_kv_head

    @property
    def intermediate_size(self) -> int:
        return self.config.intermediate_size // self.size

    @property
    def expert_intermediate_size(self) -> int:
        return self.config.moe.intermediate_size // self.size

    @property
    def shared_expert_intermediate_size(self) -> int:
        return self.config.moe.shared_expert_intermediate_size // self.size

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding and the LM head on each rank: the vocabulary padded to a multiple of the ranks."""
        return -(-self.config.vocab_size // self.size)

    @property
    def first_vocab_row(self) -> int:
        return self.rank * self.vocab_rows

    @property
    def num_real_vocab_rows(self) -> int:
        """Rows holding tokens (the last rank's padding rows hold none)."""
        return max(0, min(self.config.vocab_size - self.first_vocab_row, self.vocab_rows))

    def checkpoint_slice(self, name: str) -> Slice | None:
        """The part of checkpoint tensor `name` this rank loads; None: all of it (norms; everything at size 1)."""
        if self.size == 1:
            return None
        head_dim = self.config.head_dim
        leaf = name.rsplit(".", 2)[-2:]  # e.g. ["q_proj", "weight"]
        module, kind = leaf[0], leaf[-1]
        if module == "q_proj":
            return Slice(0, self.rank * self.num_heads * head_dim, self.num_heads * head_dim)
        if module in ("k_proj", "v_proj"):
            return Slice(0, self.first_kv_head * head_dim, self.num_kv_heads * head_dim)
        if module in ("gate_proj", "up_proj"):
            size = self._intermediate_size_of(name)
            return Slice(0, self.rank * size, size)
        if module == "o_proj" and kind == "weight":
            return Slice(1, self.rank * self.num_heads * head_dim, self.num_heads * head_dim)
        if module == "down_proj" and kind == "weight":
            size = self._intermediate_size_of(name)
            return Slice(1, self.rank * size, size)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return Slice(0, self.first_vocab_row, self.num_real_vocab_rows)
        return None

    def _intermediate_size_of(self, name: str) -> int:
        """This rank's share of the MLP that checkpoint tensor `name` belongs to: an expert, the shared expert
        (Qwen2-MoE) or a dense layer's."""
        if ".experts." in name:
            return self.expert_intermediate_size
        if ".shared_expert." in name:
            return self.shared_expert_intermediate_size
        return self.intermediate_size

    def zero_on_this_rank(self, name: str) -> bool:
        """Row-parallel biases are added once, to the all-reduce's sum: rank 0 holds them, the others zeros."""
        return self.rank > 0 and name.endswith(("o_proj.bias", "down_proj.bias"))
