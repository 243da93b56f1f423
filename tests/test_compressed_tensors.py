"""compressed-tensors checkpoints made by llm-compressor (tests/data/compressed_tensors/, made by
`python -P -m kvserve.testing.compressed_tensors_fixtures`): the engine's greedy tokens and logprobs equal HF
transformers' loading the same checkpoint (through the `compressed-tensors` package, which decompresses it) on every
scheduling path, for every scheme kvserve runs; weights stay compressed in memory; what kvserve cannot run is
refused at start-up by name.

Logprobs within 1e-4, as for unquantized checkpoints, where only weights are quantized: they are those HF runs, bit
for bit (checked below), so the results differ only by the order of float32 sums, as the dense path's do. Where
inputs are quantized too (W8A8, FP8_DYNAMIC), within 0.1: the inputs are quantized with the package's own
arithmetic (checked bit for bit below), but a sum in another order upstream may put an input on the other side of
a rounding edge (for int8 a step of 1/127.5 of its token's largest value), and these tiny random models amplify
that: HF's own reference run in float64 instead of float32 moves the greedy tokens' logprobs by up to 0.05 (W8A8)
and 0.09 (FP8_DYNAMIC). The tokens are equal all the same.
"""

import json
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp
from safetensors import safe_open
from transformers import AutoModelForCausalLM, CompressedTensorsConfig

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.compressed_tensors_checkpoint import (
    CheckpointTensors,
    CompressedTensorsError,
    check_splits_groups,
    load_weight,
    quantization_config,
)
from kvserve.engine.model_loader import CheckpointError
from kvserve.engine.models.layers import Linear, weight_bytes
from kvserve.engine.parallel.sharding import TensorParallelError
from kvserve.kernels.cpu_backend import CpuBackend
from kvserve.kernels.cpu_extension import load_cpu_kernels
from kvserve.kernels.group_quant import (
    chunked_group_quantized_linear,
    concat_rows,
    dequantize,
    group_quantized_linear,
    padded_rows,
    quantize_activations,
)
from kvserve.testing.group_weights import random_group_weight
from tests.test_parity import (
    SCHEDULING_PATHS,
    assert_matches_hf,
    assert_prefix_cached_run_matches_hf,
    build_hf_reference,
    recorded_graph_replays,
)

CT_DIR = Path(__file__).parent / "data" / "compressed_tensors"
# Every scheme kvserve runs: int8 groups of 128 packed in words; int4 groups, symmetric with bfloat16 scales and
# asymmetric (llama); float8 per channel with float8 inputs (qwen3's q/k norms); float8 per tensor; int8 per channel
# with int8 inputs, one layer's MLP left dense.
CHECKPOINTS = ["qwen2-w8a16", "qwen2-w4a16-bf16", "llama-w4a16-asym", "qwen3-fp8-dynamic", "qwen2-fp8-tensor",
               "qwen2-w8a8"]  # fmt: skip
QUANTIZED_INPUTS = ("qwen3-fp8-dynamic", "qwen2-w8a8")


def tolerance(checkpoint: Path) -> float:
    return 0.1 if checkpoint.name in QUANTIZED_INPUTS else 1e-4


# The parity models' KV blocks: 2 layers x 2 heads x 32 values, K and V, float32: 16 tokens take 16 KiB.
BLOCK_BYTES = 2 * 2 * 2 * 32 * 4 * 16
# HF's default for these checkpoints keeps them compressed, which runs on a CPU for none of them (transformers 5.24,
# with compressed-tensors 0.19 or 0.20, could not even load zero points packed along the rows); decompressed, every
# scheme loads, with the weights bit for bit, but not the inputs' quantization
# (`quantize_inputs_as_compressed_tensors_does`).
DECOMPRESSED = CompressedTensorsConfig(run_compressed=False)


def scheduling_paths() -> dict[str, dict]:
    """The parity paths, with KV budgets of the same number of blocks (10) for these models' blocks."""
    return {
        name: {**settings, "kv_cache_memory_bytes": 10 * BLOCK_BYTES} if "kv_cache_memory_bytes" in settings
        else settings
        for name, settings in SCHEDULING_PATHS.items()
    }  # fmt: skip


def quantize_inputs_as_compressed_tensors_does(model_dir: Path):
    """For `build_hf_reference`: decompressed, HF's layers run their inputs unquantized; this puts back the
    package's own dynamic input quantization (its scale computation and fake quantization, as its quantized
    forward calls them) on each layer whose config group quantizes inputs."""
    groups = json.loads((model_dir / "config.json").read_text())["quantization_config"]["config_groups"]
    inputs = {name: group.get("input_activations") for name, group in groups.items()}
    config = quantization_config(model_dir)

    def prepare(model) -> None:
        for name, module in model.named_modules():
            scheme = config.scheme_for(name) if isinstance(module, torch.nn.Linear) else None
            group_inputs = next((inputs[g] for g, s in zip(groups, config.schemes, strict=True) if s is scheme), None)
            if group_inputs:
                args = QuantizationArgs(**group_inputs)

                def quantize(layer, positional, args=args):
                    (x,) = positional
                    scale, zero_point = compute_dynamic_scales_and_zp(x, args, module=layer)
                    return (fake_quantize(x, scale, zero_point, args),)

                module.register_forward_pre_hook(quantize)

    return prepare


def hf_reference_of(model_dir: Path):
    prepare = quantize_inputs_as_compressed_tensors_does(model_dir)
    return build_hf_reference(model_dir, prepare_model=prepare, quantization_config=DECOMPRESSED)


def hf_model(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, quantization_config=DECOMPRESSED)


@pytest.fixture(scope="module", params=CHECKPOINTS)
def checkpoint(request) -> Path:
    return CT_DIR / request.param


@pytest.fixture(scope="module")
def hf_reference(checkpoint):
    return hf_reference_of(checkpoint)


@pytest.mark.parametrize("path", sorted(SCHEDULING_PATHS))
def test_greedy_tokens_and_logprobs_match_hf(checkpoint, hf_reference, path):
    with LLM(str(checkpoint), **scheduling_paths()[path]) as llm:
        assert_matches_hf(llm, hf_reference, path, tolerance(checkpoint))


def test_torch_backend_matches_hf(checkpoint, hf_reference):
    with LLM(str(checkpoint), attention_backend="torch", **scheduling_paths()["chunked_preempting"]) as llm:
        assert_matches_hf(llm, hf_reference, "chunked_preempting", tolerance(checkpoint))


def test_prefix_cached_run_matches_hf(checkpoint, hf_reference):
    assert_prefix_cached_run_matches_hf(checkpoint, hf_reference, tolerance(checkpoint))


def test_weights_are_hfs_bit_for_bit(checkpoint):
    """Every quantized layer's weight, dequantized by the reference, equals the one HF decompressed; every layer
    the config quantizes is held quantized, the others (W8A8's second MLP) dense."""
    hf = hf_model(checkpoint)
    config = quantization_config(checkpoint)
    tensors = CheckpointTensors([safe_open(str(checkpoint / "model.safetensors"), framework="pt")])
    quantized = 0
    for name, module in hf.named_modules():
        scheme = config.scheme_for(name) if isinstance(module, torch.nn.Linear) else None
        if scheme is None:
            continue
        weight = load_weight(tensors, name, scheme)
        assert torch.equal(dequantize(weight), module.weight.float()), name
        quantized += 1
    # 7 projections a layer, in 4 of kvserve's (q/k/v and gate/up are one each); W8A8 leaves layer 1's MLP dense
    expected, expected_held = (11, 6) if checkpoint.name == "qwen2-w8a8" else (14, 8)
    assert quantized == expected
    with LLM(str(checkpoint)) as llm:
        model = llm.engine.core.runner.worker.model
        held = [module for module in model.modules() if isinstance(module, Linear) and module.grouped is not None]
        assert len(held) == expected_held


def test_weights_stay_compressed_in_memory():
    """Resident weight bytes within 10% of the checkpoint's tensor bytes: values, scales and zero points as stored
    (4-bit values two a byte), no dense copy beside them; the dense tensors in the checkpoint's dtype (on a CPU
    kvserve runs float32 unless asked otherwise)."""
    for name in ("qwen2-w4a16-bf16", "llama-w4a16-asym", "qwen2-w8a16", "qwen3-fp8-dynamic"):
        path = CT_DIR / name
        with safe_open(str(path / "model.safetensors"), framework="pt") as shard:
            file_bytes = sum(shard.get_tensor(key).nbytes for key in shard.keys())  # noqa: SIM118
        with LLM(str(path), dtype="bfloat16" if name.endswith("bf16") else "float32") as llm:
            assert file_bytes * 0.9 <= weight_bytes(llm.engine.core.runner.worker.model) <= file_bytes * 1.1, name


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_inputs_are_quantized_as_compressed_tensors_quantizes_them(kind):
    """Dynamic per-token input quantization equals the package's own (bit for bit, a zero row included)."""
    args = QuantizationArgs(num_bits=8, type="int" if kind == "int8" else "float", strategy="token", dynamic=True,
                            symmetric=True)  # fmt: skip
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)) * torch.tensor([[1], [3], [0], [0.01], [100]])
    scale, zero_point = compute_dynamic_scales_and_zp(x.unsqueeze(0), args, module=torch.nn.Linear(64, 1))
    theirs = fake_quantize(x.unsqueeze(0), scale, zero_point, args)[0]
    ours = quantize_activations(x, kind)
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, x)


def test_the_torch_path_matches_the_reference_and_quantizes_inputs():
    weight = random_group_weight(8, rows=600, columns=64)  # more rows than one chunk
    x, bias = torch.randn(3, 64), torch.randn(600)
    reference = group_quantized_linear(x, weight, bias)
    assert torch.allclose(chunked_group_quantized_linear(x, weight, bias), reference, atol=1e-5)
    with_inputs = replace(weight, activations="int8")
    assert torch.allclose(chunked_group_quantized_linear(x, with_inputs, bias),
                          group_quantized_linear(x, with_inputs, bias), atol=1e-5)  # fmt: skip
    assert not torch.allclose(group_quantized_linear(x, with_inputs, bias), reference, atol=1e-4)


@pytest.mark.skipif(not load_cpu_kernels(), reason="the C++ kernels could not be built here")
@pytest.mark.parametrize(("kind", "zero_points"), [(8, False), (8, True), (4, False), (4, True), ("fp8", False)])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_size", [32, 256])
def test_the_cpu_kernels_widen_as_the_reference_and_multiply_within_float32_rounding(
    kind, zero_points, scale_dtype, group_size
):
    """Every layout the C++ kernels take: the weight widened bit for bit as the reference dequantizes it (float8's
    subnormals too; a bfloat16 product rounded to bfloat16), and the linear layer within float32 rounding of the
    reference on 1-4 rows (one pass over the weight), 7 (the register tile) and 70 (widened chunks and a GEMM)."""
    weight = random_group_weight(kind, scale_dtype, zero_points, group_size)
    widened = torch.empty(weight.out_features, weight.in_features)
    torch.ops.kvserve_cpu.group_quant_dequantize(
        widened, weight.values, weight.num_bits, weight.scales, weight.zero_points, group_size
    )
    assert torch.equal(widened, dequantize(weight))
    for rows in (1, 3, 7, 70):
        x = torch.randn(rows, weight.in_features)
        bias = torch.randn(weight.out_features)
        ours = CpuBackend().group_quantized_linear(x, weight, bias)
        assert torch.allclose(ours, group_quantized_linear(x, weight, bias), atol=1e-4, rtol=1e-5), rows


@pytest.mark.skipif(not load_cpu_kernels(), reason="the C++ kernels could not be built here")
def test_the_cpu_backend_quantizes_inputs_and_sends_float16_scales_to_the_torch_path():
    x = torch.randn(5, 256)
    for activations in ("int8", "fp8"):
        with_inputs = replace(random_group_weight(8, torch.float32, False, 256), activations=activations)
        assert torch.allclose(CpuBackend().group_quantized_linear(x, with_inputs, None),
                              group_quantized_linear(x, with_inputs, None), atol=1e-4)  # fmt: skip
    half_scales = random_group_weight(8, torch.float16, False, 32)
    assert torch.allclose(CpuBackend().group_quantized_linear(x, half_scales, None),
                          group_quantized_linear(x, half_scales, None), atol=1e-4)  # fmt: skip


@pytest.mark.parametrize("num_bits", [4, 8])
@pytest.mark.parametrize("rows", [16, 13])
def test_packed_values_and_zero_points_are_read_as_the_package_unpacks_them(tmp_path, num_bits, rows):
    """Values packed along the rows' features and zero points packed along the rows (13 rows: a word left part
    empty), read from a file as the loader reads a checkpoint, equal the package's unpacking."""
    generator = torch.Generator().manual_seed(num_bits)
    low, high = -(1 << (num_bits - 1)), 1 << (num_bits - 1)
    values = torch.randint(low, high, (rows, 64), dtype=torch.int8, generator=generator)
    zero_points = torch.randint(low, high, (rows, 2), dtype=torch.int8, generator=generator)
    from safetensors.torch import save_file

    tensors = {
        "layer.weight_packed": pack_to_int32(values, num_bits),
        "layer.weight_shape": torch.tensor([rows, 64]),
        "layer.weight_scale": torch.rand(rows, 2),
        "layer.weight_zero_point": pack_to_int32(zero_points, num_bits, packed_dim=0).contiguous(),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    scheme_json = {"format": "pack-quantized", "targets": ["Linear"], "weights": {
        "num_bits": num_bits, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32}}  # fmt: skip
    config = {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"g": scheme_json}}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    scheme = quantization_config(tmp_path).schemes[0]
    shard = safe_open(str(tmp_path / "model.safetensors"), framework="pt")
    weight = load_weight(CheckpointTensors([shard]), "layer", scheme)
    assert torch.equal(weight.zero_points, unpack_from_int32(tensors["layer.weight_zero_point"], num_bits,
                                                             torch.Size([rows, 2]), packed_dim=0))  # fmt: skip
    unpacked = unpack_from_int32(tensors["layer.weight_packed"], num_bits, torch.Size([rows, 64]))
    expected = (unpacked.float() - zero_points.float().repeat_interleave(32, dim=1)) * tensors[
        "layer.weight_scale"
    ].repeat_interleave(32, dim=1)
    assert torch.equal(dequantize(weight), expected)


def test_slices_and_concatenations_keep_each_rows_values():
    weight = random_group_weight(8, rows=8, columns=64)
    dense = dequantize(weight)
    assert torch.equal(dequantize(weight.rows(2, 3)), dense[2:5])
    assert torch.equal(dequantize(weight.columns(32, 32)), dense[:, 32:])
    assert torch.equal(dequantize(concat_rows([weight.rows(0, 4), weight.rows(4, 4)])), dense)
    padded = dequantize(padded_rows(weight, 10))
    assert torch.equal(padded[:8], dense) and not padded[8:].any()
    with pytest.raises(ValueError, match="cut through one"):
        weight.columns(16, 32)
    per_channel = random_group_weight(8, group_size=64, rows=8, columns=64)
    assert torch.equal(dequantize(per_channel.columns(16, 32)), dequantize(per_channel)[:, 16:48])


@pytest.mark.parametrize("name", ["qwen2-w4a16-bf16", "qwen2-w8a16", "qwen3-fp8-dynamic", "qwen2-w8a8"])
def test_two_ranks_give_hf_tokens_batched_chunked_and_preempting(name):
    """Each rank holds its rows of the column-parallel weights and whole groups of the row-parallel ones (W8A16's
    o_proj rows are one group of 128: each rank's half keeps the row's scale; per channel the same)."""
    path = CT_DIR / name
    reference = hf_reference_of(path)
    settings = {"max_num_seqs": 4, "max_num_batched_tokens": 20, "kv_cache_memory_bytes": 5 * BLOCK_BYTES}
    with LLM(str(path), tensor_parallel_size=2, **settings) as llm:
        assert llm.engine.core.model.plan.size == 2
        assert_matches_hf(llm, reference, "chunked_preempting", tolerance(path))


def test_a_split_through_groups_is_refused_before_any_rank_starts(tmp_path):
    """Rows of 384 features in 3 groups of 128 cannot be shared by two ranks; a row of one group can (its scale
    holds for any share), as can rows of 2 groups."""
    scheme = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}
    config = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": scheme}}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": config}))
    quantization = quantization_config(tmp_path)
    shapes = {"num_layers": 2, "num_heads": 4, "head_dim": 32}
    check_splits_groups(quantization, SimpleNamespace(intermediate_size=256, **shapes), 2)  # o_proj: one group
    with pytest.raises(TensorParallelError, match=r"does not split model\.layers\.0\.mlp\.down_proj: its 384"):
        check_splits_groups(quantization, SimpleNamespace(intermediate_size=384, **shapes), 2)


@pytest.mark.skipif(not load_cpu_kernels(), reason="the eager replay reads device buffers only with the C++ kernels")
def test_decode_graphs_replayed_over_quantized_weights_give_hf_tokens():
    path = CT_DIR / "qwen2-w8a8"
    with LLM(str(path), eager_graph_replay=True, max_num_seqs=4) as llm:
        replays = recorded_graph_replays(llm)
        assert_matches_hf(llm, hf_reference_of(path), "staggered", tolerance(path))
    assert replays


def test_int8_kv_cache_over_compressed_weights_gives_the_dense_twins_tokens(tmp_path):
    """INT8 KV over int4 weights gives what INT8 KV over the same weights decompressed (saved as a plain float32
    checkpoint) gives: the same tokens, logprobs within 1e-4 (the KV rounding sees the same values either way)."""
    source = CT_DIR / "llama-w4a16-asym"
    loaded = hf_model(source)
    dense = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    dense.load_state_dict({k: v for k, v in loaded.state_dict().items() if ".weight_" not in k})
    dense.save_pretrained(tmp_path / "dense")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        shutil.copy(source / name, tmp_path / "dense" / name)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    prompts = [[5 + i, 40 + 3 * i, 77, 91 + i, 120] * (i + 1) for i in range(4)]
    runs = []
    for model in (source, tmp_path / "dense"):
        with LLM(str(model), kv_cache_dtype="int8", **SCHEDULING_PATHS["staggered"]) as llm:
            runs.append(llm.generate(prompts, params))
    for quantized, twin in zip(*runs, strict=True):
        assert quantized.token_ids == twin.token_ids
        assert [e.logprob for e in quantized.logprobs] == pytest.approx([e.logprob for e in twin.logprobs], abs=1e-4)


def _with_quantization(tmp_path: Path, change) -> Path:
    """A copy of the W4A16 checkpoint with its quantization_config changed by `change`."""
    out = tmp_path / "changed"
    shutil.copytree(CT_DIR / "qwen2-w4a16-bf16", out)
    config = json.loads((out / "config.json").read_text())
    change(config["quantization_config"])
    (out / "config.json").write_text(json.dumps(config))
    return out


def _set(path: str, value):
    def change(quantization: dict) -> None:
        *parents, leaf = path.split(".")
        target = quantization
        for key in parents:
            target = target[key]
        target[leaf] = value

    return change


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (_set("quant_method", "gptq"), "quantization_config.quant_method 'gptq' is not supported"),
        (_set("kv_cache_scheme", {"num_bits": 8, "type": "float"}), "quantization_config.kv_cache_scheme"),
        (_set("sparsity_config", {"format": "sparse-24-bitmask"}), "quantization_config.sparsity_config"),
        (_set("config_groups.group_0.format", "marlin-24"), "config_groups.group_0.format 'marlin-24'"),
        (_set("config_groups.group_0.weights.strategy", "block"), "weights.strategy 'block' is not supported"),
        (_set("config_groups.group_0.weights.num_bits", 2), "int 2-bit weights are not supported"),
        (_set("config_groups.group_0.weights.actorder", "group"), "weights.actorder 'group' is not supported"),
        (_set("config_groups.group_0.input_activations", {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                          "dynamic": False}), "input_activations (float8 tensor"),
        (_set("config_groups.group_0.output_activations", {"num_bits": 8}), "output_activations"),
        (_set("quantization_status", "frozen"), "quantization_status 'frozen'"),
    ],
)  # fmt: skip
def test_what_kvserve_does_not_run_is_refused_by_name(tmp_path, change, named):
    with pytest.raises(CompressedTensorsError, match=named.replace("(", r"\(")):
        LLM(str(_with_quantization(tmp_path, change)))


def test_quantized_tensors_no_layer_takes_are_refused_by_name(tmp_path):
    """Ignoring the MLPs in the config while the file has them quantized: the leftover tensors are named."""
    path = _with_quantization(tmp_path, _set("ignore", ["lm_head", "re:.*mlp.*"]))
    with pytest.raises(CompressedTensorsError, match=r"model\.layers\.0\.mlp\.down_proj\.weight_packed is quantized"):
        LLM(str(path))


def test_a_cut_short_checkpoint_is_refused_naming_its_file(tmp_path):
    """A file that cannot be read (a copy still being written) is named as for any checkpoint, not a traceback."""
    path = _with_quantization(tmp_path, lambda quantization: None)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors cannot be read"):
        LLM(str(path))


def test_a_packed_projection_quantized_in_part_is_refused(tmp_path):
    path = _with_quantization(tmp_path, _set("ignore", ["lm_head", "re:.*k_proj"]))
    with pytest.raises(CompressedTensorsError, match="computed together, and only some are quantized"):
        LLM(str(path))


def test_kvserve_serve_a_compressed_tensors_checkpoint_to_the_openai_client(tmp_path):
    """A JSON schema constrains the answer; the start-up log names the schemes and the bytes held."""
    from tests.test_server_process import assert_answers_within_a_json_schema, serve_process

    with serve_process(CT_DIR / "llama-w4a16-asym", tmp_path, "--served-model-name", "tiny-ct") as server:
        assert_answers_within_a_json_schema(server, "tiny-ct")
        log = server.log()
    assert "compressed-tensors: int4 asymmetric per group 32 (pack-quantized); 8 linear layers quantized" in log, log


def test_kvserve_serve_refuses_an_unsupported_checkpoint_with_one_line(tmp_path):
    from tests.test_server_process import refusal_of

    path = _with_quantization(tmp_path, _set("quant_method", "awq"))
    assert "'awq'" in refusal_of(path, tmp_path)
