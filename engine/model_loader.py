"""Build a model from a HF checkpoint directory (config.json plus safetensors, single or sharded; a compressed-tensors
checkpoint's quantized weights stay quantized: engine/compressed_tensors_checkpoint.py) or a GGUF file
(engine/gguf_checkpoint.py: its quantized tensors stay quantized too).

Only local directories and safetensors files are read: pickle checkpoints (`*.bin`, `*.pt`) can run
code when unpickled, and `trust_remote_code` is never set, so a checkpoint cannot bring its own code.
"""

import json
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import AutoConfig

from kvserve.engine import compressed_tensors_checkpoint
from kvserve.engine.gguf_checkpoint import (
    GgufFile,
    find_gguf,
    load_dense_weights,
    log_loaded,
    quantize_layers,
    release_readers,
)
from kvserve.engine.gguf_checkpoint import hf_config as gguf_hf_config
from kvserve.engine.models import DecoderConfig, DecoderForCausalLM, architecture_of, decoder_config_from_hf
from kvserve.engine.models.layers import Linear, PackedLinear, RMSNorm
from kvserve.engine.models.moe import Experts, SparseMoeBlock
from kvserve.engine.models.registry import is_headless
from kvserve.engine.models.rope import RotaryEmbedding
from kvserve.engine.parallel.group import TensorParallelGroup
from kvserve.engine.parallel.sharding import ShardPlan, Slice, TensorParallelError
from kvserve.kernels import KernelBackend

# Buffers some checkpoints carry that kvserve recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Weight files in pickle formats: named when refused, never opened.
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl")


class CheckpointError(ValueError):
    """The checkpoint directory is missing, or its files do not match the model its config describes."""


def check_checkpoint_dir(model_dir: Path) -> None:
    """Refuse what is not a local checkpoint directory or GGUF file before any loader looks at it (and tries a
    hub)."""
    gguf_path = find_gguf(model_dir)
    if gguf_path is not None:
        GgufFile(gguf_path)  # its architecture and tensor types, refused by name here
        return
    if not model_dir.is_dir():
        raise CheckpointError(f"no checkpoint directory at {model_dir} (kvserve loads local directories only)")
    if not (model_dir / "config.json").is_file():
        raise CheckpointError(f"no config.json in {model_dir}")
    if "auto_map" in json.loads((model_dir / "config.json").read_text()):
        raise CheckpointError(f"{model_dir}/config.json asks for the checkpoint's own code (auto_map): never run")
    compressed_tensors_checkpoint.quantization_config(model_dir)  # what kvserve cannot run, refused by name here


def load_model(
    model_dir: str | Path, dtype: torch.dtype, device: torch.device, group: TensorParallelGroup | None = None
) -> DecoderForCausalLM:
    """Build the model on the meta device, allocate it once in `dtype` on `device`, fill it from the checkpoint.

    With a tensor-parallel `group`, this rank's shard only, read from the checkpoint slice by slice.
    """
    model_dir = Path(model_dir)
    gguf_path = find_gguf(model_dir)
    hf_config = _hf_config(model_dir)
    architecture = architecture_of(hf_config)
    config = architecture.build_config(hf_config)
    plan = ShardPlan.of(config, group.rank, group.size) if group is not None else ShardPlan(config)
    with torch.device("meta"):
        model = architecture.model_class(config, plan, group).to(dtype)
    gguf_file = GgufFile(gguf_path) if gguf_path is not None else None
    quantization = compressed_tensors_checkpoint.quantization_config(model_dir) if gguf_file is None else None
    if gguf_file is not None:
        quantize_layers(model, gguf_file)
    elif quantization is not None:
        with ExitStack() as files:
            shards = [files.enter_context(_open_shard(path)) for path in _safetensors_files(model_dir)]
            tensors = compressed_tensors_checkpoint.CheckpointTensors(shards)
            quantized_layers = compressed_tensors_checkpoint.quantize_layers(model, quantization, tensors, device)
    model.to_empty(device=device)
    model.tie_weights()
    if is_headless(getattr(hf_config, "architectures", None)) and not config.tie_word_embeddings:
        with torch.no_grad():
            model.lm_head.weight.zero_()  # no checkpoint tensor fills it: embeddings never read it
    if group is not None:  # what no slice fills stays zero: vocabulary padding, other ranks' row-parallel biases
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.zero_()
    for module in model.modules():  # buffers `to_empty` left uninitialized
        if isinstance(module, RotaryEmbedding):
            module.compute_tables()
        elif isinstance(module, SparseMoeBlock):
            module.expert_tokens.zero_()
    if gguf_file is not None:
        load_dense_weights(model, gguf_file, checkpoint_destinations(model))
        log_loaded(model, gguf_file)
        del gguf_file
        release_readers()
    else:
        files = _safetensors_files(model_dir)
        _load_weights(model, files, skip=tensors.consumed if quantization is not None else frozenset(),
                      headless=is_headless(getattr(hf_config, "architectures", None)))  # fmt: skip
        if quantization is not None:
            file_bytes = sum(path.stat().st_size for path in files)
            compressed_tensors_checkpoint.log_loaded(model, quantization, quantized_layers, file_bytes)
    if config.norm_weight_offset:
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, RMSNorm):
                    module.weight.add_(config.norm_weight_offset)
    return model.eval()


def prepare_weights(model: nn.Module, backend: KernelBackend) -> None:
    """Give every linear layer and expert block the backend's own form of its weights (on a CPU, oneDNN's packed
    copies), made once, now that the weights are loaded."""
    for module in model.modules():
        if isinstance(module, Linear) and module.weight is not None:
            module.prepared = backend.prepare_linear(module.weight)
        elif isinstance(module, Experts):
            module.prepared = backend.prepare_experts(module.gate_up_weight, module.down_weight)


def load_decoder_config(model_dir: Path) -> DecoderConfig:
    return decoder_config_from_hf(_hf_config(model_dir))


def _hf_config(model_dir: Path):
    gguf_path = find_gguf(model_dir)
    if gguf_path is not None:
        return gguf_hf_config(gguf_path)
    return AutoConfig.from_pretrained(str(model_dir), trust_remote_code=False)


def checkpoint_dtype(model_dir: str | Path) -> torch.dtype | None:
    """The dtype the checkpoint declares in config.json, if any (a GGUF file declares none: its types are per
    tensor)."""
    if find_gguf(model_dir) is not None:
        return None
    config = json.loads((Path(model_dir) / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype")
    return getattr(torch, name) if isinstance(name, str) and hasattr(torch, name) else None


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    pickles = sorted(path.name for path in model_dir.iterdir() if path.suffix in _PICKLE_SUFFIXES)
    refused = f"; {', '.join(pickles)} not loaded: kvserve reads safetensors only, never pickle" if pickles else ""
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {model_dir}{refused}")


def checkpoint_destinations(model: DecoderForCausalLM) -> dict[str, torch.Tensor]:
    """Each checkpoint tensor's name and the parameter, or part of a packed or stacked parameter, it fills."""
    destinations = {}
    for module_name, module in model.named_modules():
        if isinstance(module, PackedLinear | Experts):
            destinations.update(module.checkpoint_tensors(module_name))
        else:
            for name, parameter in module.named_parameters(recurse=False):
                destinations[f"{module_name}.{name}"] = parameter
    if model.config.tie_word_embeddings:
        destinations.pop("lm_head.weight", None)  # the embedding's weight
    return destinations


def fused_destinations(model: DecoderForCausalLM) -> dict[str, tuple[torch.Tensor, list[str]]]:
    """Packed parameters by the name a fused checkpoint (Phi-3's `qkv_proj`, `gate_up_proj`) stores them under,
    with the part names each stands for."""
    fused = {}
    for module_name, module in model.named_modules():
        if isinstance(module, PackedLinear):
            for name, parts in module.fused_checkpoint_names(module_name).items():
                fused[name] = (model.get_parameter(name), parts)
    return fused


def _load_weights(
    model: DecoderForCausalLM, files: list[Path], skip: set[str] | frozenset = frozenset(), headless: bool = False
) -> None:
    """Fill the model's dense parameters from the checkpoint's files (`skip`: tensors already loaded elsewhere, the
    quantized weights' parts; `headless`: a decoder saved without its LM head and its "model." prefix, whose head
    stays zero)."""
    plan = model.plan
    expected = checkpoint_destinations(model)
    if headless:
        expected.pop("lm_head.weight", None)
    destinations = {name: (tensor, [name]) for name, tensor in expected.items()}
    fused = fused_destinations(model)
    destinations.update(fused)
    loaded: set[str] = set()
    with torch.no_grad():
        for path in files:
            with _open_shard(path) as shard:
                for stored_name in shard.keys():  # noqa: SIM118 - safe_open has no __iter__
                    if stored_name in skip:
                        continue
                    name = _renamed(stored_name, model.config.checkpoint_renames)
                    if headless and name not in destinations:
                        name = f"model.{name}"
                    if name.endswith(_IGNORED_SUFFIXES) or (
                        name == "lm_head.weight" and model.config.tie_word_embeddings
                    ):
                        continue
                    if name not in destinations:
                        raise CheckpointError(f"unexpected weight {stored_name!r} in {path.name}")
                    if name in fused and plan.size > 1:
                        raise TensorParallelError(f"tensor parallelism cannot split fused weights ({stored_name})")
                    destination, filled_names = destinations[name]
                    loaded.update(filled_names)
                    if plan.zero_on_this_rank(name):
                        continue
                    part = plan.checkpoint_slice(name)
                    tensor = _read(shard, stored_name, part)
                    if part is not None and part.dim == 0 and part.length < destination.shape[0]:
                        destination = destination[: part.length]  # the vocabulary's padding rows stay zero
                    if tensor.shape != destination.shape:
                        raise CheckpointError(
                            f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(destination.shape)}"
                        )
                    destination.copy_(tensor)
    missing = sorted(set(expected) - loaded)
    if missing:
        raise CheckpointError(f"checkpoint lacks weights: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")


@contextmanager
def _open_shard(path: Path):
    """A safetensors file, or a `CheckpointError` naming it: missing, or unreadable (cut short, as a copy still
    being written is). Errors while reading its tensors name it too."""
    if not path.is_file():
        raise CheckpointError(f"{path.name} is missing from {path.parent} (model.safetensors.index.json lists it)")
    try:
        with safe_open(str(path), framework="pt") as shard:
            yield shard
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{path.name} cannot be read ({error}): is it complete?") from None


def _read(shard, name: str, part: Slice | None) -> torch.Tensor:
    """The tensor, or only its slice `part` (safetensors reads just those bytes)."""
    if part is None:
        return shard.get_tensor(name)
    view = shard.get_slice(name)
    end = part.start + part.length
    return view[part.start : end] if part.dim == 0 else view[:, part.start : end]


def _renamed(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    for stored, ours in renames:
        name = name.replace(stored, ours)
    return name
