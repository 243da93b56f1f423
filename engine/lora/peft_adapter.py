"""Reading a LoRA adapter saved by PEFT (`adapter_config.json` + `adapter_model.safetensors`) into host tensors.

Each adapted module's A [r, in] and B [out, r] are kept in float32 on the host with the adapter's scaling folded into
B: `lora_alpha / r`, or `lora_alpha / sqrt(r)` with rsLoRA, per module where `rank_pattern`/`alpha_pattern` say.
What would change the model beyond a low-rank delta on linear layers (DoRA, `modules_to_save`, trained biases,
new token embeddings, expert parameters, ...) is refused by name, never ignored; so are settings this reader does
not know, unless they are off.
"""

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

# Settings that only shape training or initialisation, or say what was targeted (the saved weights say it too).
_TRAINING_ONLY = {
    "alpha_pattern", "auto_mapping", "base_model_name_or_path", "bias", "corda_config", "ensure_weight_tying",
    "eva_config", "exclude_modules", "inference_mode", "init_lora_weights", "layers_pattern", "layers_to_transform",
    "loftq_config", "lora_alpha", "lora_dropout", "lora_ga_config", "megatron_config", "megatron_core", "peft_type",
    "peft_version", "qalora_group_size", "r", "rank_pattern", "revision", "target_modules", "task_type", "use_rslora",
}  # fmt: skip
# Settings that change what the adapter computes beyond W x + B A x: refused when set.
_REFUSED = {
    "use_dora": "DoRA (use_dora) is not supported",
    "modules_to_save": "modules_to_save (fully trained copies of modules) is not supported",
    "trainable_token_indices": "trainable_token_indices (new token embeddings) is not supported",
    "target_parameters": "target_parameters (LoRA on parameters, e.g. MoE experts) is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "lora_bias": "lora_bias (a trained bias on lora_B) is not supported",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights) is not supported",
    "use_qalora": "QA-LoRA (use_qalora) is not supported",
    "layer_replication": "layer_replication is not supported",
}
_WEIGHT_NAME = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>A|B)\.weight$")
_REFUSED_TARGETS = {
    "embed_tokens": "LoRA on the embeddings (embed_tokens) is not supported",
    "lm_head": "LoRA on the LM head (lm_head) is not supported",
    "experts": "LoRA on MoE experts is not supported (the attention and dense MLP layers are)",
}


class LoraAdapterError(ValueError):
    """The adapter cannot be read, or asks for something kvserve does not run; the message names it."""


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter as read from its directory: per adapted module (its name in the base checkpoint, e.g.
    `model.layers.0.self_attn.q_proj`), A [r, in] and B [out, r] with the scaling folded in, float32 on the host."""

    name: str
    path: str
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def rank(self) -> int:
        return max(a.shape[0] for a, _ in self.weights.values())

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def read_peft_adapter(name: str, path: str | Path, max_rank: int) -> LoraAdapter:
    """The adapter in directory `path`; `LoraAdapterError` naming what is wrong or refused."""
    directory = Path(path)
    config = _read_config(directory)
    weights_path = directory / "adapter_model.safetensors"
    if not weights_path.is_file():
        pickled = (directory / "adapter_model.bin").is_file()
        why = ": adapter_model.bin is pickle, which kvserve never loads" if pickled else ""
        raise LoraAdapterError(f"no adapter_model.safetensors in {directory}{why}")
    pairs = _read_pairs(weights_path)
    weights = {}
    for module, (a, b) in sorted(pairs.items()):
        rank = a.shape[0]
        if b.shape[1] != rank:
            raise LoraAdapterError(f"{module}: lora_A has rank {rank} but lora_B {tuple(b.shape)}")
        if rank > max_rank:
            raise LoraAdapterError(f"{module} has rank {rank}, more than max_lora_rank ({max_rank})")
        weights[module] = (a, b * _scaling(config, module, rank))
    if not weights:
        raise LoraAdapterError(f"{weights_path} holds no lora_A/lora_B weights")
    return LoraAdapter(name, str(directory), weights)


def _read_config(directory: Path) -> dict:
    config_path = directory / "adapter_config.json"
    if not config_path.is_file():
        raise LoraAdapterError(f"no adapter_config.json in {directory} (a PEFT adapter directory)")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise LoraAdapterError(f"{config_path} is not valid JSON ({error})") from None
    if config.get("peft_type") != "LORA":
        raise LoraAdapterError(f"peft_type {config.get('peft_type')!r} is not supported (LORA is)")
    if config.get("bias", "none") != "none":
        raise LoraAdapterError(f"bias {config['bias']!r} (trained biases) is not supported (none is)")
    for key, value in config.items():
        if key in _REFUSED and value:
            raise LoraAdapterError(_REFUSED[key])
        if key not in _REFUSED and key not in _TRAINING_ONLY and value:
            raise LoraAdapterError(f"adapter setting {key!r} is not supported")
    return config


def _read_pairs(weights_path: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_path), framework="pt") as tensors:
            for stored in tensors.keys():  # noqa: SIM118 - safe_open has no __iter__
                match = _WEIGHT_NAME.match(stored)
                if match is None:
                    raise LoraAdapterError(f"unexpected tensor {stored!r} in {weights_path.name}")
                module = match["module"]
                refused = next((why for part, why in _REFUSED_TARGETS.items() if part in module.split(".")), None)
                if refused is not None:
                    raise LoraAdapterError(f"{refused} ({module})")
                halves.setdefault(module, {})[match["which"]] = tensors.get_tensor(stored).float()
    except (SafetensorError, OSError) as error:
        raise LoraAdapterError(f"{weights_path} cannot be read ({error})") from None
    pairs = {}
    for module, half in halves.items():
        if set(half) != {"A", "B"}:
            raise LoraAdapterError(f"{module} has lora_{next(iter(half))} but not its other half")
        pairs[module] = (half["A"].contiguous(), half["B"].contiguous())
    return pairs


def _scaling(config: dict, module: str, rank: int) -> float:
    """alpha / r (alpha / sqrt(r) with rsLoRA), with `alpha_pattern`'s alpha where one of its keys matches the
    module's name as PEFT matches them (the name, or its end after a dot)."""
    alpha = config.get("lora_alpha", 8)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            alpha = value
            break
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
