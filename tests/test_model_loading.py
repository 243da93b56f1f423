"""Checkpoints load through config.json and safetensors; bad ones fail with a clear error."""

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, MistralConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvserve.engine.model_loader import CheckpointError, checkpoint_destinations, load_model
from kvserve.engine.models import UnsupportedModelError, decoder_config_from_hf
from kvserve.engine.models.rope import RopeConfig, UnsupportedRopeError, inverse_frequencies

ROPE_CASES = {
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    },
    "yarn": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32768},
    "yarn_mscale": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
        "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
    },
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_inverse_frequencies_match_hf(case):
    parameters = ROPE_CASES[case]
    hf_config = LlamaConfig(
        hidden_size=1024, num_attention_heads=8, max_position_embeddings=131072, rope_parameters=dict(parameters)
    )
    expected_inv_freq, expected_factor = ROPE_INIT_FUNCTIONS[parameters["rope_type"]](hf_config, "cpu")
    inv_freq, factor = inverse_frequencies(
        RopeConfig(
            head_dim=128, theta=parameters["rope_theta"], rope_type=parameters["rope_type"], parameters=parameters
        )
    )
    torch.testing.assert_close(inv_freq, expected_inv_freq.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(expected_factor)


def test_unknown_rope_type_is_refused():
    with pytest.raises(UnsupportedRopeError, match="'dynamic'"):
        inverse_frequencies(RopeConfig(head_dim=64, theta=1e4, rope_type="dynamic"))


def test_mistral_maps_onto_the_llama_decoder_and_its_sliding_window_caps_the_context():
    config = MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=32768, sliding_window=4096, architectures=["MistralForCausalLM"],
    )  # fmt: skip
    decoder = decoder_config_from_hf(config)
    assert (decoder.num_kv_heads, decoder.head_dim, decoder.qkv_bias, decoder.qk_norm) == (2, 16, False, False)
    assert decoder.max_position_embeddings == 4096


def test_unsupported_architecture_is_refused_with_the_supported_list():
    config = LlamaConfig(architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError, match="Qwen3ForCausalLM"):
        decoder_config_from_hf(config)


def _copy(checkpoint, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(checkpoint, target)
    return target


def test_a_missing_weight_is_named(tiny_checkpoints, tmp_path):
    model_dir = _copy(tiny_checkpoints["qwen2"], tmp_path)
    weights = load_file(model_dir / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, model_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match=re.escape("model.layers.1.mlp.up_proj.weight")):
        load_model(model_dir, torch.float32, torch.device("cpu"))


def test_an_unexpected_or_misshapen_weight_is_named(tiny_checkpoints, tmp_path):
    model_dir = _copy(tiny_checkpoints["qwen2"], tmp_path)
    weights = load_file(model_dir / "model.safetensors")
    weights["model.layers.0.mlp.down_proj.weight"] = weights["model.layers.0.mlp.down_proj.weight"].T.contiguous()
    save_file(weights, model_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"down_proj\.weight.*shape"):
        load_model(model_dir, torch.float32, torch.device("cpu"))
    weights["model.layers.0.mlp.down_proj.weight"] = weights["model.layers.0.mlp.down_proj.weight"].T.contiguous()
    weights["model.layers.0.extra.weight"] = torch.zeros(2)
    save_file(weights, model_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match=re.escape("unexpected weight 'model.layers.0.extra.weight'")):
        load_model(model_dir, torch.float32, torch.device("cpu"))


def test_sharded_checkpoints_load_every_shard(tiny_checkpoints):
    model_dir = tiny_checkpoints["llama"]
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    destinations = checkpoint_destinations(model)
    for name, shard in index["weight_map"].items():
        expected = load_file(model_dir / shard)[name]
        torch.testing.assert_close(destinations[name], expected, rtol=0, atol=0)


def test_projections_of_one_input_are_packed_in_checkpoint_order(tiny_checkpoints):
    model_dir = tiny_checkpoints["qwen2"]  # q/k/v biases too
    weights = load_file(model_dir / "model.safetensors")
    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    attention, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    for packed, parts in (
        (attention.qkv_proj, ("q_proj", "k_proj", "v_proj")),
        (mlp.gate_up_proj, ("gate_proj", "up_proj")),
    ):
        prefix = "model.layers.1.self_attn" if packed is attention.qkv_proj else "model.layers.1.mlp"
        for kind in ("weight", "bias") if packed.bias is not None else ("weight",):
            expected = torch.cat([weights[f"{prefix}.{part}.{kind}"] for part in parts])
            torch.testing.assert_close(getattr(packed, kind), expected, rtol=0, atol=0)


def test_tied_embeddings_share_one_tensor(tiny_checkpoints):
    model = load_model(tiny_checkpoints["qwen3"], torch.float32, torch.device("cpu"))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_no_safetensors_is_a_checkpoint_error(tiny_checkpoints, tmp_path):
    model_dir = _copy(tiny_checkpoints["qwen2"], tmp_path)
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=re.escape("no model.safetensors")):
        load_model(model_dir, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_model_loads_and_generates_in_each_cpu_dtype_whatever_the_cpu_packs(tiny_checkpoints, dtype):
    """Where this CPU's oneDNN cannot pack a dtype (bfloat16 without AVX-512), the CPU backend keeps the layers'
    plain weights (the reorder would raise at load time); where it can, it packs them. Either way the model runs."""
    from kvserve.engine import LLM, SamplingParams
    from kvserve.engine.models.layers import Linear
    from kvserve.kernels import onednn
    from kvserve.kernels.cpu_extension import load_cpu_kernels

    llm = LLM(str(tiny_checkpoints["llama"]), dtype=dtype, kv_cache_memory_bytes=1 << 22)
    linears = [module for module in llm.engine.core.model.modules() if isinstance(module, Linear)]
    packs = onednn.cpu_packs(getattr(torch, dtype))
    assert {linear.prepared is not None for linear in linears} == {packs and load_cpu_kernels()}
    (output,) = llm.generate(["Once upon a time"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(output.token_ids) == 4
