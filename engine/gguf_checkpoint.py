"""GGUF files (llama.cpp's format) as checkpoints: `kvserve serve model.gguf`, or a directory holding one.

The config, tokenizer and chat template come from the file's metadata, read by transformers' own GGUF support (so
they are what `from_pretrained(dir, gguf_file=...)` gives a user of HF). The tensors are read by the `gguf`
package's reader and kept in their quantized form: each linear layer whose tensor is quantized holds it as the
engine's block-quantized weight (kernels/block_quant.py), byte for byte the file's; the embedding too. Tensors of
the formats kvserve computes on (F32, F16, BF16, Q8_0, Q4_0, Q5_0, Q4_K, Q6_K) load; any other is refused at
start-up by name.

llama.cpp's converter reorders the rows of q_proj and k_proj of `llama` files (Llama, Mistral) for its interleaved
rotary embedding; they are put back in HF's order here, whole rows of blocks at a time.
"""

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import AutoConfig, AutoTokenizer

from kvserve.engine.models.layers import Linear, QuantizedEmbedding, weight_bytes
from kvserve.engine.parallel.sharding import ShardPlan, TensorParallelError
from kvserve.kernels.block_quant import (
    FORMATS,
    BlockQuantError,
    QuantizedWeight,
    concat_rows,
    dequantize,
    padded_rows,
)

logger = logging.getLogger(__name__)

# The GGML tensor types kvserve computes on, by the engine's format name.
FORMAT_OF_TYPE = {
    gguf.GGMLQuantizationType.F32: "f32",
    gguf.GGMLQuantizationType.F16: "f16",
    gguf.GGMLQuantizationType.BF16: "bf16",
    gguf.GGMLQuantizationType.Q8_0: "q8_0",
    gguf.GGMLQuantizationType.Q4_0: "q4_0",
    gguf.GGMLQuantizationType.Q5_0: "q5_0",
    gguf.GGMLQuantizationType.Q4_K: "q4_k",
    gguf.GGMLQuantizationType.Q6_K: "q6_k",
}
# GGUF architectures whose tensors map onto kvserve's decoder (`general.architecture`); Mistral files say llama.
ARCHITECTURES = ("llama", "qwen2", "qwen3")
_ARCH_BY_NAME = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}


class GgufError(ValueError):
    """The GGUF file cannot be served: unreadable, or an architecture or tensor type kvserve does not run."""


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names, or the one in directory `path` (which then has no config.json); None if it
    is not a GGUF checkpoint."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if not path.is_dir() or (path / "config.json").exists():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise GgufError(f"{path} holds several GGUF files ({', '.join(f.name for f in files)}): name one")
    return files[0] if files else None


# The HF architecture of each model type transformers reads from a GGUF file (its config names none).
_HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def hf_config(path: Path):
    """The HF config transformers reads from the file, with its architecture named and the head size the file
    states (transformers does not read it for every family: a qwen3 file's heads would be 128 wide whatever they
    are). Read once per version of the file: parsing a large vocabulary's metadata takes seconds."""
    return _hf_config(path.resolve(), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _hf_config(path: Path, mtime_ns: int):
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, trust_remote_code=False)
    architecture = _HF_ARCHITECTURES.get(config.model_type)
    config.architectures = [architecture] if architecture else []
    reader = _reader(path, mtime_ns)
    key_length = reader.get_field(f"{reader.get_field('general.architecture').contents()}.attention.key_length")
    if key_length is not None:
        config.head_dim = int(key_length.contents())
    return config


@functools.lru_cache(maxsize=4)
def _reader(path: Path, mtime_ns: int) -> gguf.GGUFReader:
    """The `gguf` package's reader of the file (it maps the file and parses its metadata and tensor index), shared
    by start-up's steps until `release_readers`."""
    return gguf.GGUFReader(path)


def release_readers() -> None:
    """Drop the readers once the weights are copied out: each maps its whole file (pages read stay resident while
    it is mapped) and holds the metadata parsed into many small arrays."""
    _reader.cache_clear()


def load_tokenizer(path: Path):
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, trust_remote_code=False)


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of the file: its shape as torch writes it ([rows, columns]) and its bytes, in memory (a copy)."""

    name: str
    format: str
    shape: tuple[int, ...]
    data: torch.Tensor  # uint8 [rows, row bytes]

    def quantized(self) -> QuantizedWeight:
        return QuantizedWeight(FORMATS[self.format], self.data, self.shape[-1])

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The values as a `dtype` tensor of `shape` (norms, biases and float32 weights)."""
        rows = self.data.reshape(-1, self.data.shape[-1])
        return dequantize(QuantizedWeight(FORMATS[self.format], rows, self.shape[-1])).reshape(self.shape).to(dtype)


class GgufFile:
    """A GGUF file's architecture and tensors, read once (the file is memory-mapped while it is open and each
    tensor copied out as it is taken)."""

    def __init__(self, path: Path) -> None:
        try:
            self.reader = _reader(path.resolve(), path.stat().st_mtime_ns)
        except (ValueError, OSError) as error:
            raise GgufError(f"{path.name} cannot be read as GGUF ({error}): is it complete?") from None
        self.path = path
        self.architecture = self._string("general.architecture")
        if self.architecture not in ARCHITECTURES:
            raise GgufError(
                f"{path.name}: GGUF architecture {self.architecture!r} is not supported; kvserve loads "
                f"{', '.join(ARCHITECTURES)} GGUF files"
            )
        self._tensors = {tensor.name: tensor for tensor in self.reader.tensors}
        self._check_types()

    def _string(self, key: str) -> str:
        field = self.reader.get_field(key)
        if field is None:
            raise GgufError(f"{self.path.name} has no {key}")
        return field.contents()

    def _check_types(self) -> None:
        unsupported = sorted(
            {t.tensor_type.name for t in self._tensors.values() if t.tensor_type not in FORMAT_OF_TYPE}
        )
        if unsupported:
            supported = ", ".join(t.name for t in FORMAT_OF_TYPE)
            raise GgufError(
                f"{self.path.name} holds tensors of type {', '.join(unsupported)}, which kvserve does not compute "
                f"on (it runs {supported})"
            )

    def tensor_names(self, num_layers: int) -> "TensorNames":
        return TensorNames(gguf.get_tensor_name_map(_ARCH_BY_NAME[self.architecture], num_layers), self)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def format_of(self, name: str) -> str:
        return FORMAT_OF_TYPE[self._tensors[name].tensor_type]

    def take(self, name: str) -> GgufTensor:
        tensor = self._tensors[name]
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))  # GGML lists the columns first
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        data = torch.from_numpy(np.array(np.asarray(tensor.data).view(np.uint8).reshape(rows, -1)))
        try:
            return GgufTensor(name, FORMAT_OF_TYPE[tensor.tensor_type], shape, data)
        except BlockQuantError as error:
            raise GgufError(f"{self.path.name}: tensor {name}: {error}") from None

    def tensor_bytes(self) -> int:
        return sum(int(tensor.n_bytes) for tensor in self._tensors.values())

    def type_counts(self) -> dict[str, int]:
        """Tensors of each format, for the start-up log."""
        counts: dict[str, int] = {}
        for tensor in self._tensors.values():
            counts[FORMAT_OF_TYPE[tensor.tensor_type]] = counts.get(FORMAT_OF_TYPE[tensor.tensor_type], 0) + 1
        return counts


@dataclass(frozen=True)
class TensorNames:
    """HF checkpoint names (what kvserve's modules are named after) to the file's GGUF names."""

    mapping: gguf.TensorNameMap
    file: GgufFile

    def of(self, hf_name: str) -> str | None:
        return self.mapping.get_name(hf_name, try_suffixes=(".weight", ".bias"))

    def reorders_rows(self, hf_name: str) -> bool:
        """Whether the converter interleaved this tensor's rows for llama.cpp's rotary embedding."""
        return self.file.architecture == "llama" and hf_name.endswith(
            ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")
        )


def hf_row_order(data: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's converter's reordering of a q or k projection's rows (or bias): within each head it
    interleaves the rows of the two halves that rotate together; HF keeps the halves apart."""
    half = data.shape[0] // num_heads // 2
    return data.reshape(num_heads, half, 2, -1).transpose(1, 2).reshape(data.shape).contiguous()


def quantize_layers(model, file: GgufFile) -> None:
    """Give every linear layer whose tensors the file quantizes (anything but F32) those tensors, and the embedding
    its table if quantized, before the model is allocated: those layers never get a dense weight. With tensor
    parallelism, this rank's slice of each, as `ShardPlan` gives it (column-parallel ones by rows, row-parallel
    ones by whole blocks of columns; a slice that would cut a block is refused)."""
    names = file.tensor_names(model.config.num_layers)
    plan, tied = model.plan, model.config.tie_word_embeddings
    embedding_name = _required(names, "model.embed_tokens.weight")
    if file.format_of(embedding_name) != "f32":
        table = _rank_slice(file.take(embedding_name).quantized(), plan, "model.embed_tokens.weight")
        if plan.size > 1:
            table = padded_rows(table, plan.vocab_rows)
        dtype = model.lm_head.weight.dtype
        model.model.embed_tokens = QuantizedEmbedding(table, dtype, plan.first_vocab_row, model.group)
    for module_name, module in model.named_modules():
        if not isinstance(module, Linear) or (tied and module is model.lm_head):
            continue
        hf_names = module.checkpoint_weight_names(module_name)
        stored = [_required(names, hf_name) for hf_name in hf_names]
        if all(file.format_of(name) == "f32" for name in stored):
            continue
        segments = []
        for hf_name, name in zip(hf_names, stored, strict=True):
            weight = file.take(name).quantized()
            if names.reorders_rows(hf_name):
                data = hf_row_order(weight.data, weight.out_features // model.config.head_dim)
                weight = QuantizedWeight(weight.format, data, weight.in_features)
            segments.append(_rank_slice(weight, plan, hf_name))
        if module is model.lm_head and plan.size > 1:  # the last rank's vocabulary padding rows
            segments[-1] = padded_rows(segments[-1], module.out_features)
        module.quantize(_merged(segments))
    model.tie_weights()


def load_dense_weights(model, file: GgufFile, destinations: dict[str, torch.Tensor]) -> None:
    """Fill the model's dense parameters (`destinations`: checkpoint name to tensor, after allocation) from the
    file's tensors, widened to the model's dtype; with tensor parallelism, this rank's slices (what no slice fills
    stays as allocated: zero)."""
    names, plan = file.tensor_names(model.config.num_layers), model.plan
    with torch.no_grad():
        for hf_name, destination in destinations.items():
            if plan.zero_on_this_rank(hf_name):
                continue
            tensor = file.take(_required(names, hf_name)).dense(destination.dtype)
            if names.reorders_rows(hf_name):
                tensor = hf_row_order(tensor, tensor.shape[0] // model.config.head_dim)
            part = plan.checkpoint_slice(hf_name)
            if part is not None:
                tensor = tensor.narrow(part.dim, part.start, part.length)
                if part.dim == 0 and part.length < destination.shape[0]:
                    destination = destination[: part.length]  # the vocabulary's padding rows stay zero
            if tensor.shape != destination.shape:
                raise GgufError(
                    f"{file.path.name}: {hf_name} has shape {list(tensor.shape)}, expected {list(destination.shape)}"
                )
            destination.copy_(tensor)


# The GGUF names of the row-parallel projections, split across ranks along their rows' values.
_ROW_PARALLEL = ("attn_output.weight", "ffn_down.weight")


def check_splits_blocks(path: Path, size: int) -> None:
    """`TensorParallelError` naming the first row-parallel tensor whose share of each row, over `size` ranks, is not
    whole blocks of its type (a Q4_K row of 4864 values has 19 blocks of 256: two ranks cannot split it)."""
    file = GgufFile(path)
    for tensor in file.reader.tensors:
        block = FORMATS[FORMAT_OF_TYPE[tensor.tensor_type]].block_size
        row = int(tensor.shape[0])  # GGML lists the columns first
        if tensor.name.endswith(_ROW_PARALLEL) and (row % size or (row // size) % block):
            raise TensorParallelError(
                f"tensor_parallel_size {size} does not split {tensor.name} of {path.name}: rows of {row} values in "
                f"{tensor.tensor_type.name} blocks of {block} do not divide into {size} whole-block shares"
            )


def _rank_slice(weight: QuantizedWeight, plan: ShardPlan, hf_name: str) -> QuantizedWeight:
    part = plan.checkpoint_slice(hf_name)
    if part is None:
        return weight
    if part.dim == 0:  # a copy: a view would keep the whole tensor's bytes alive on every rank
        rows = weight.rows(part.start, part.length)
        return QuantizedWeight(rows.format, rows.data.clone(), rows.in_features)
    try:
        return weight.columns(part.start, part.length)
    except BlockQuantError as error:
        raise TensorParallelError(
            f"tensor_parallel_size {plan.size} splits {hf_name} inside its {weight.format.name} blocks ({error})"
        ) from None


def log_loaded(model, file: GgufFile) -> None:
    """The start-up log's line on the file: its format, tensor types and the bytes the weights take."""
    types = ", ".join(f"{count} {name}" for name, count in sorted(file.type_counts().items()))
    logger.info(
        "GGUF %s (%s): tensors %s; weights held in %.1f MiB (the file's tensors: %.1f MiB)",
        file.path.name, file.architecture, types, weight_bytes(model) / 2**20, file.tensor_bytes() / 2**20,
    )  # fmt: skip


def _required(names: TensorNames, hf_name: str) -> str:
    name = names.of(hf_name)
    if name is None or not names.file.has(name):
        raise GgufError(f"{names.file.path.name} lacks the tensor of {hf_name} ({name or 'no GGUF name'})")
    return name


def _merged(segments: list[QuantizedWeight]) -> tuple[QuantizedWeight, ...]:
    """Neighbouring segments of one format as one (one kernel call for q, k and v when they share it)."""
    runs: list[list[QuantizedWeight]] = []
    for segment in segments:
        if runs and runs[-1][0].format == segment.format:
            runs[-1].append(segment)
        else:
            runs.append([segment])
    return tuple(run[0] if len(run) == 1 else concat_rows(run) for run in runs)
