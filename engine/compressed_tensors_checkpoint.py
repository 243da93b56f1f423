"""compressed-tensors checkpoints (vLLM's main quantized format, written by llm-compressor): an HF checkpoint whose
config.json has a `quantization_config` with `quant_method: compressed-tensors`, and whose quantized linear layers
store their weights compressed. kvserve keeps them so (kernels/group_quant.py) and runs:

- integer weights of 8 or 4 bits (W8A16, W4A16), a scale per channel, per group of input features or per tensor,
  symmetric or with zero points (asymmetric), in the `pack-quantized`, `int-quantized` or `naive-quantized` format;
- float8 (e4m3) weights with a scale per channel or per tensor (`float-quantized`, `naive-quantized`);
- with either, the layer's input quantized dynamically per token, symmetric, to int8 (W8A8) or float8 (FP8_DYNAMIC).

Everything else a `quantization_config` can say is refused at start-up, by name: other quantization methods (GPTQ,
AWQ, bitsandbytes ... in their own formats), static activation scales, output activations, block strategies,
activation ordering with group indices, sparsity, transforms, a KV-cache scheme, quantized embeddings or experts.
"""

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.engine.models.layers import Linear, weight_bytes
from kvserve.engine.parallel.sharding import ShardPlan, TensorParallelError
from kvserve.kernels.group_quant import (
    GroupQuantError,
    GroupQuantizedWeight,
    concat_rows,
    padded_rows,
)

logger = logging.getLogger(__name__)

METHOD = "compressed-tensors"
_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
# What a quantized module stores beside (or instead of) its `weight`.
_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")


class CompressedTensorsError(ValueError):
    """The checkpoint's quantization is something kvserve does not run, or its tensors do not match it."""


@dataclass(frozen=True)
class WeightScheme:
    """One config group's weights (and inputs): what kvserve needs to hold and compute them."""

    format: str
    kind: str  # "int" or "float"
    num_bits: int
    strategy: str  # "channel", "group" or "tensor"
    group_size: int | None
    symmetric: bool
    activations: str | None  # None, "int8" or "fp8": the input quantized dynamically per token
    targets: tuple[str, ...]

    def describe(self) -> str:
        weights = f"{self.kind}{self.num_bits}" + ("" if self.symmetric else " asymmetric")
        scales = f"group {self.group_size}" if self.strategy == "group" else self.strategy
        inputs = f", inputs {self.activations} per token" if self.activations else ""
        return f"{weights} per {scales}{inputs} ({self.format})"


@dataclass(frozen=True)
class QuantizationConfig:
    schemes: tuple[WeightScheme, ...]
    ignore: tuple[str, ...]

    def scheme_for(self, module_name: str) -> WeightScheme | None:
        """The scheme of the first config group whose targets match this linear module, unless it is ignored."""
        if any(_matches(pattern, module_name) for pattern in self.ignore):
            return None
        for scheme in self.schemes:
            if any(_matches(pattern, module_name) for pattern in scheme.targets):
                return scheme
        return None


def _matches(pattern: str, module_name: str) -> bool:
    """compressed-tensors' target syntax: `re:<regex>` matched at the start of the module's name, or the module's
    name itself, or its class name (every module this is asked about is a `Linear`)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module_name) is not None
    return pattern in (module_name, "Linear")


def quantization_config(model_dir: Path) -> QuantizationConfig | None:
    """The checkpoint's compressed-tensors quantization, None if it declares none; anything kvserve does not run
    refused by name (`CompressedTensorsError`)."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        return None
    quantization = json.loads(config_path.read_text()).get("quantization_config")
    if quantization is None:
        return None
    method = quantization.get("quant_method")
    if method != METHOD:
        raise CompressedTensorsError(
            f"quantization_config.quant_method {method!r} is not supported: kvserve runs compressed-tensors "
            "checkpoints (made by llm-compressor) and GGUF files"
        )
    status = quantization.get("quantization_status", "compressed")
    if status != "compressed":
        raise CompressedTensorsError(f"quantization_config.quantization_status {status!r}: only 'compressed' is run")
    for key, meaning in (
        ("sparsity_config", "sparse weights"),
        ("transform_config", "weight transforms"),
        ("kv_cache_scheme", "a quantized KV cache from the checkpoint (kvserve's own is --kv-cache-dtype int8)"),
    ):
        if quantization.get(key):
            raise CompressedTensorsError(f"quantization_config.{key} ({meaning}) is not supported")
    groups = quantization.get("config_groups") or {}
    if not groups:
        raise CompressedTensorsError("quantization_config has no config_groups")
    schemes = tuple(_scheme(name, group, quantization.get("format")) for name, group in groups.items())
    return QuantizationConfig(schemes, tuple(quantization.get("ignore") or ()))


def _scheme(name: str, group: dict, default_format: str | None) -> WeightScheme:
    where = f"quantization_config.config_groups.{name}"
    format_name = group.get("format") or default_format
    if format_name not in _FORMATS:
        raise CompressedTensorsError(f"{where}.format {format_name!r} is not supported (kvserve runs {_FORMATS})")
    if group.get("output_activations"):
        raise CompressedTensorsError(f"{where}.output_activations: quantized outputs are not supported")
    weights = group.get("weights")
    if not weights:
        raise CompressedTensorsError(f"{where}.weights: groups without quantized weights are not supported")
    kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    if (kind, bits) not in (("int", 8), ("int", 4), ("float", 8)):
        raise CompressedTensorsError(f"{where}.weights: {kind} {bits}-bit weights are not supported (int8, int4, fp8)")
    if strategy not in ("channel", "group", "tensor"):
        raise CompressedTensorsError(f"{where}.weights.strategy {strategy!r} is not supported (channel, group, tensor)")
    symmetric = weights.get("symmetric", True)
    if not symmetric and (kind == "float" or strategy == "tensor"):
        raise CompressedTensorsError(f"{where}.weights: asymmetric {kind} weights per {strategy} are not supported")
    allowed_values = {"dynamic": (False, None), "actorder": (None, "weight", "static"), "scale_dtype": (None,)}
    for key, allowed in allowed_values.items():
        if weights.get(key) not in allowed:
            raise CompressedTensorsError(f"{where}.weights.{key} {weights.get(key)!r} is not supported")
    if format_name == "float-quantized" and kind != "float":
        raise CompressedTensorsError(f"{where}: float-quantized format with {kind} weights")
    if format_name in ("pack-quantized", "int-quantized") and kind != "int":
        raise CompressedTensorsError(f"{where}: {format_name} format with {kind} weights")
    group_size = weights.get("group_size") if strategy == "group" else None
    if strategy == "group" and not (isinstance(group_size, int) and group_size > 0):
        raise CompressedTensorsError(f"{where}.weights.group_size {group_size!r} is not a positive integer")
    return WeightScheme(
        format_name, kind, bits, strategy, group_size, symmetric, _activations(where, group.get("input_activations")),
        tuple(group.get("targets") or ()),
    )  # fmt: skip


def _activations(where: str, inputs: dict | None) -> str | None:
    if not inputs:
        return None
    described = f"{inputs.get('type')}{inputs.get('num_bits')} {inputs.get('strategy')}"
    dynamic_per_token = inputs.get("dynamic") is True and inputs.get("strategy") == "token"
    if not (dynamic_per_token and inputs.get("symmetric", True) and inputs.get("num_bits") == 8):
        raise CompressedTensorsError(
            f"{where}.input_activations ({described}, dynamic={inputs.get('dynamic')}, symmetric="
            f"{inputs.get('symmetric')}) is not supported: only dynamic symmetric 8-bit per-token inputs are"
        )
    kinds = {"int": "int8", "float": "fp8"}
    if inputs.get("type") not in kinds:
        raise CompressedTensorsError(f"{where}.input_activations.type {inputs.get('type')!r} is not supported")
    return kinds[inputs["type"]]


class CheckpointTensors:
    """The checkpoint's tensors by name, read on demand from its open safetensors files (the loader opens them, so
    that a file that cannot be read is named as for any checkpoint)."""

    def __init__(self, shards: list) -> None:
        self._shard_of = {name: shard for shard in shards for name in shard.keys()}  # noqa: SIM118 - no __iter__
        self.consumed: set[str] = set()

    def names(self) -> list[str]:
        return list(self._shard_of)

    def take(self, name: str) -> torch.Tensor:
        if name not in self._shard_of:
            raise CompressedTensorsError(f"the checkpoint lacks {name}")
        self.consumed.add(name)
        return self._shard_of[name].get_tensor(name)


def load_weight(tensors: CheckpointTensors, module: str, scheme: WeightScheme) -> GroupQuantizedWeight:
    """The module's quantized weight, whole, as kvserve holds it."""
    if scheme.format == "pack-quantized":
        out_features, in_features = tensors.take(f"{module}.weight_shape").tolist()
        packed = tensors.take(f"{module}.weight_packed")
        expected = (out_features, in_features * scheme.num_bits // 32)
        if packed.dtype != torch.int32 or tuple(packed.shape) != expected or in_features % 8:
            raise CompressedTensorsError(
                f"{module}.weight_packed is {packed.dtype} {list(packed.shape)}, expected int32 {list(expected)}"
            )
        values = packed.contiguous().view(torch.uint8)  # little-endian words: value 0 in the lowest bits
        if scheme.num_bits == 8:
            values = (values ^ 0x80).view(torch.int8)  # stored as q + 128
    else:
        values = tensors.take(f"{module}.weight")
        expected_dtype = torch.float8_e4m3fn if scheme.kind == "float" else torch.int8
        if values.dtype != expected_dtype or values.dim() != 2:
            raise CompressedTensorsError(f"{module}.weight is {values.dtype} {list(values.shape)}")
        out_features, in_features = values.shape
        if scheme.num_bits == 4:  # naive: one int8 a value; kvserve keeps two a byte
            offset = (values.to(torch.int16) + 8).to(torch.uint8).reshape(out_features, -1, 2)
            values = offset[..., 0] | (offset[..., 1] << 4)
    group_size = scheme.group_size if scheme.strategy == "group" else in_features
    if in_features % group_size:
        raise CompressedTensorsError(f"{module}: groups of {group_size} do not divide rows of {in_features}")
    scales = tensors.take(f"{module}.weight_scale")
    if scheme.strategy == "tensor":
        if scales.numel() != 1:
            raise CompressedTensorsError(f"{module}.weight_scale holds {scales.numel()} values, expected one")
        scales = scales.reshape(1, 1).expand(out_features, 1).contiguous()
    zero_points = None if scheme.symmetric else _zero_points(tensors, module, scheme, out_features, scales.shape)
    try:
        return GroupQuantizedWeight(values, scheme.num_bits, scales, zero_points, group_size, in_features,
                                    scheme.activations)  # fmt: skip
    except GroupQuantError as error:
        raise CompressedTensorsError(f"{module}: {error}") from None


def _zero_points(tensors: CheckpointTensors, module: str, scheme: WeightScheme, rows: int, shape) -> torch.Tensor:
    """int8 [rows, groups]. pack-quantized packs them along the rows, [rows * bits / 32, groups] words with row 0
    in the lowest bits, offset as the values are; the other formats store them as they are."""
    stored = tensors.take(f"{module}.weight_zero_point")
    if scheme.format != "pack-quantized":
        return stored.reshape(shape).to(torch.int8)
    words = stored.t().contiguous().view(torch.uint8)  # [groups, rows * bits / 8]
    if scheme.num_bits == 4:
        offset = torch.stack([words & 0x0F, words >> 4], dim=-1).reshape(words.shape[0], -1)
        unpacked = offset.to(torch.int8) - 8
    else:
        unpacked = (words ^ 0x80).view(torch.int8)
    return unpacked[:, :rows].t().contiguous()


def quantize_layers(model, config: QuantizationConfig, tensors: CheckpointTensors, device: torch.device) -> int:
    """Give every linear layer the config quantizes its weight (this rank's share of it), before the model is
    allocated: those layers never get a dense weight. Returns how many layers were quantized."""
    plan: ShardPlan = model.plan
    count = 0
    for module_name, module in model.named_modules():
        if not isinstance(module, Linear) or (model.config.tie_word_embeddings and module is model.lm_head):
            continue
        weight_names = module.checkpoint_weight_names(module_name)
        parts = [name.removesuffix(".weight") for name in weight_names]
        schemes = {part: config.scheme_for(part) for part in parts}
        if all(scheme is None for scheme in schemes.values()):
            continue
        if any(scheme is None for scheme in schemes.values()):
            raise CompressedTensorsError(f"{', '.join(parts)} are computed together, and only some are quantized")
        weights = []
        for part, weight_name in zip(parts, weight_names, strict=True):
            weights.append(_rank_share(load_weight(tensors, part, schemes[part]), plan, weight_name))
        try:
            weight = concat_rows(weights) if len(weights) > 1 else weights[0]
        except GroupQuantError as error:
            raise CompressedTensorsError(f"{', '.join(parts)}: {error}") from None
        if module is model.lm_head and weight.out_features < module.out_features:  # vocabulary padding rows
            weight = padded_rows(weight, module.out_features)
        if (weight.out_features, weight.in_features) != (module.out_features, module.in_features):
            raise CompressedTensorsError(
                f"{', '.join(parts)}: quantized weight of [{weight.out_features}, {weight.in_features}] for a "
                f"[{module.out_features}, {module.in_features}] layer"
            )
        module.quantize_groups(weight.to(device))
        count += 1
    leftover = sorted(
        name for name in tensors.names() if name.rpartition(".")[2] in _SUFFIXES and name not in tensors.consumed
    )
    if leftover:
        raise CompressedTensorsError(
            f"{leftover[0]} is quantized, and kvserve runs quantized weights in linear layers only (not embeddings "
            "or mixture-of-experts experts)"
        )
    return count


def _rank_share(weight: GroupQuantizedWeight, plan: ShardPlan, weight_name: str) -> GroupQuantizedWeight:
    share = plan.checkpoint_slice(weight_name)
    if share is None:
        return weight
    if share.dim == 0:
        return weight.rows(share.start, share.length).clone()
    try:
        return weight.columns(share.start, share.length)
    except GroupQuantError as error:
        raise TensorParallelError(f"tensor_parallel_size {plan.size} splits {weight_name}: {error}") from None


def check_splits_groups(config: QuantizationConfig, decoder_config, size: int) -> None:
    """`TensorParallelError` naming the first row-parallel projection whose input features, over `size` ranks, are
    not whole groups on each rank (checked before the ranks start)."""
    widths = {
        "self_attn.o_proj": decoder_config.num_heads * decoder_config.head_dim,
        "mlp.down_proj": decoder_config.intermediate_size,
    }
    for layer in range(decoder_config.num_layers):
        for projection, width in widths.items():
            module = f"model.layers.{layer}.{projection}"
            scheme = config.scheme_for(module)
            if scheme is None or scheme.strategy != "group" or scheme.group_size == width:
                continue  # a scale per row (or per tensor) holds for any share of the row
            if width % size or (width // size) % scheme.group_size:
                raise TensorParallelError(
                    f"tensor_parallel_size {size} does not split {module}: its {width} input features in groups "
                    f"of {scheme.group_size} do not divide into {size} whole-group shares"
                )


def log_loaded(model, config: QuantizationConfig, quantized_layers: int, file_bytes: int) -> None:
    """The start-up log's line: the schemes, how many layers use them and the bytes the weights take (beside the
    bytes of the checkpoint's files)."""
    logger.info(
        "compressed-tensors: %s; %d linear layers quantized; weights held in %.1f MiB (the checkpoint's files: "
        "%.1f MiB)", "; ".join(scheme.describe() for scheme in config.schemes), quantized_layers,
        weight_bytes(model) / 2**20, file_bytes / 2**20,
    )  # fmt: skip
