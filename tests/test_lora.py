"""Multi-LoRA serving in the engine: greedy tokens and logprobs equal HF transformers + PEFT for each adapter, with
adapters of different ranks and target modules mixed in one batch with base-model requests, on every scheduling path
and backend; adapters swapped through fewer slots than adapters; loaded at run time as at start; unloaded for good."""

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.lora.peft_adapter import LoraAdapterError, read_peft_adapter
from kvserve.testing.lora_adapters import write_peft_adapter
from tests.test_parity import SCHEDULING_PATHS, assert_matches_hf, build_hf_reference, recorded_graph_replays
from tests.test_phi3 import phi3  # noqa: F401 - the fixture

# Ranks, scalings and targets that differ: attention only; every linear layer with rsLoRA; the output projection and
# MLP with a per-module rank and alpha.
ADAPTERS = {
    "attn-r8": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "all-r4-rslora": {"r": 4, "lora_alpha": 8, "use_rslora": True, "target_modules": "all-linear"},
    "mlp-r16": {
        "r": 16, "lora_alpha": 32, "target_modules": ["o_proj", "gate_proj", "up_proj", "down_proj"],
        "rank_pattern": {"down_proj": 8}, "alpha_pattern": {"o_proj": 4},
    },
}  # fmt: skip
# Prompt i runs under MIXED[i % 4]: every batch mixes the three adapters and the base model.
MIXED = [None, "attn-r8", "all-r4-rslora", "mlp-r16"]


def _write_adapters(model_dir: Path, root: Path) -> dict[str, Path]:
    return {
        name: write_peft_adapter(model_dir, root / name, seed=index, **config)
        for index, (name, config) in enumerate(ADAPTERS.items())
    }


def _mixed_reference(model_dir: Path, adapters: dict[str, Path]) -> list:
    """HF + PEFT's tokens and logprobs for prompt i under MIXED[i % 4] (the base model alone for None)."""
    references = {None: build_hf_reference(model_dir)}
    for name, path in adapters.items():
        references[name] = build_hf_reference(model_dir, prepare_model=lambda model, path=path: _load_peft(model, path))
    return [references[_mixed_name(i)][i] for i in range(len(references[None]))]


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> dict[str, Path]:
    return _write_adapters(tiny_model, tmp_path_factory.mktemp(f"adapters-{tiny_model.name}"))


@pytest.fixture(scope="module")
def mixed_reference(tiny_model, adapters) -> list:
    return _mixed_reference(tiny_model, adapters)


@pytest.fixture(scope="module")
def llama(tiny_checkpoints, tmp_path_factory) -> tuple[Path, dict[str, Path], list]:
    """The tiny Llama, its adapters and their mixed reference: for the Triton kernels (slow in the interpreter),
    run on one model; the torch path runs on every model."""
    model_dir = tiny_checkpoints["llama"]
    adapters = _write_adapters(model_dir, tmp_path_factory.mktemp("llama-adapters"))
    return model_dir, adapters, _mixed_reference(model_dir, adapters)


def _load_peft(model, adapter_dir: Path) -> None:
    model.load_adapter(str(adapter_dir))


def _mixed_name(index: int) -> str | None:
    return MIXED[index % len(MIXED)]


def _mixed_names(count: int) -> list[str | None]:
    return [_mixed_name(i) for i in range(count)]


def _lora_llm(model_dir: Path, adapters: dict[str, Path], **settings) -> LLM:
    modules = tuple((name, str(path)) for name, path in adapters.items())
    settings = {"max_loras": len(adapters), **settings}
    return LLM(str(model_dir), enable_lora=True, max_lora_rank=16, lora_modules=modules, **settings)


@pytest.mark.parametrize("path", ["one_batch", "staggered", "preempting", "chunked_preempting"])
def test_mixed_adapters_match_hf_and_peft(tiny_model, adapters, mixed_reference, path):
    with _lora_llm(tiny_model, adapters, **SCHEDULING_PATHS[path]) as llm:
        assert_matches_hf(llm, mixed_reference, path, lora_names=_mixed_names(len(mixed_reference)))


def test_fewer_slots_than_adapters_swap_and_match(tiny_model, adapters, mixed_reference):
    """Two slots for three adapters: a step runs requests of at most two, the others wait, and adapters are swapped
    into the least recently used slot."""
    with _lora_llm(tiny_model, adapters, max_loras=2, max_num_seqs=3) as llm:
        assert_matches_hf(llm, mixed_reference, "staggered", lora_names=_mixed_names(len(mixed_reference)))
        assert llm.engine.core.loras.num_swaps > 3


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_torch_backend_and_the_triton_kernels_match(llama, backend):
    model_dir, adapters, reference = llama
    settings = SCHEDULING_PATHS["chunked_preempting"]
    with _lora_llm(model_dir, adapters, attention_backend=backend, dtype="float32", **settings) as llm:
        assert llm.engine.core.runner.worker.backend.name == backend
        assert_matches_hf(llm, reference, "chunked_preempting", lora_names=_mixed_names(len(reference)))


def test_padded_decode_graphs_read_the_adapter_of_each_row(llama):
    """Decode graphs (replayed eagerly here) launch the LoRA kernels with the tiles of their capture."""
    model_dir, adapters, reference = llama
    with _lora_llm(model_dir, adapters, eager_graph_replay=True, attention_backend="triton", max_num_seqs=8) as llm:
        replays = recorded_graph_replays(llm)
        assert_matches_hf(llm, reference, "one_batch", lora_names=_mixed_names(len(reference)))
        assert replays and set(replays) <= {1, 2, 4, 8}


def test_adapters_loaded_at_run_time_give_the_tokens_of_adapters_loaded_at_start(tiny_model, adapters):
    prompts = [list(range(5, 5 + length)) for length in (3, 20, 40)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with _lora_llm(tiny_model, adapters) as at_start:
        expected = [output.token_ids for output in at_start.generate(prompts, params, "mlp-r16")]
    with LLM(str(tiny_model), enable_lora=True, max_lora_rank=16) as llm:
        llm.generate(prompts, params)  # the engine has run before the adapter comes
        llm.load_lora("mlp-r16", str(adapters["mlp-r16"]))
        assert [output.token_ids for output in llm.generate(prompts, params, "mlp-r16")] == expected


def test_an_unloaded_adapter_is_unknown_and_its_weights_are_let_go(tiny_model, adapters):
    prompt, params = list(range(5, 40)), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with _lora_llm(tiny_model, {"attn-r8": adapters["attn-r8"]}, enable_prefix_caching=True) as llm:
        core = llm.engine.core
        llm.generate([prompt], params, "attn-r8")
        weights = core.loras._loaded["attn-r8"].adapter.weights
        adapter_tensor = weakref.ref(weights["model.layers.0.self_attn.q_proj"][0])
        del weights
        host_bytes = core.loras.host_bytes
        assert host_bytes > 0 and core.scheduler.allocator.num_cached_blocks > 0
        assert llm.unload_lora("attn-r8")
        gc.collect()
        assert adapter_tensor() is None and core.loras.host_bytes == 0
        assert core.scheduler.allocator.num_cached_blocks == 0  # its blocks are never found again
        with pytest.raises(InvalidRequestError, match="attn-r8") as refused:
            llm.generate([prompt], params, "attn-r8")
        assert refused.value.field == "model"
        assert not llm.unload_lora("attn-r8")


def test_an_adapter_unloaded_while_its_request_runs_lets_it_finish(tiny_model, adapters):
    with _lora_llm(tiny_model, {"attn-r8": adapters["attn-r8"]}) as llm:
        engine = llm.engine
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        expected = llm.generate([list(range(5, 30))], params, "attn-r8")[0].token_ids
        request_id = engine.add_request(list(range(5, 30)), params, lora_name="attn-r8")
        deltas = engine.step()
        assert engine.unload_lora("attn-r8") and engine.core.loras.host_bytes > 0
        while engine.has_unfinished():
            deltas += engine.step()
        assert [t for d in deltas if d.request_id == request_id for t in d.token_ids] == expected
        assert engine.core.loras.host_bytes == 0


def test_blocks_computed_under_one_adapter_are_never_reused_by_another(tiny_model, adapters):
    prompt, params = list(range(5, 70)), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    with _lora_llm(tiny_model, adapters, enable_prefix_caching=True) as llm:
        scheduler = llm.engine.core.scheduler
        hits = []
        for name in ("attn-r8", "mlp-r16", None, "attn-r8"):
            before = scheduler.prefix_cache_hit_tokens
            llm.generate([prompt], params, name)
            hits.append(scheduler.prefix_cache_hit_tokens - before)
        assert hits == [0, 0, 0, 64]  # only the same adapter finds its 4 full blocks


@pytest.fixture
def adapter_dir(tiny_checkpoints, tmp_path) -> Path:
    return write_peft_adapter(tiny_checkpoints["llama"], tmp_path / "adapter", seed=0, r=4, target_modules=["q_proj"])


def _edit_config(adapter_dir: Path, **changes) -> None:
    config_path = adapter_dir / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config.update(changes)
    config_path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "bias"),
        ({"target_parameters": ["mlp.experts.gate_up_proj"]}, "target_parameters"),
        ({"peft_type": "IA3"}, "peft_type"),
        ({"some_future_switch": True}, "some_future_switch"),
    ],
)
def test_adapters_that_change_more_than_a_low_rank_delta_are_refused_by_name(adapter_dir, changes, named):
    _edit_config(adapter_dir, **changes)
    with pytest.raises(LoraAdapterError, match=named):
        read_peft_adapter("x", adapter_dir, max_rank=16)


def test_a_rank_above_max_lora_rank_and_unadaptable_modules_are_refused(adapter_dir):
    with pytest.raises(LoraAdapterError, match="max_lora_rank"):
        read_peft_adapter("x", adapter_dir, max_rank=2)
    _add_module(adapter_dir, "model.embed_tokens", in_features=512, out_features=64)
    with pytest.raises(LoraAdapterError, match="embed_tokens"):
        read_peft_adapter("x", adapter_dir, max_rank=16)
    (adapter_dir / "adapter_model.safetensors").unlink()
    with pytest.raises(LoraAdapterError, match=r"no adapter_model\.safetensors"):
        read_peft_adapter("x", adapter_dir, max_rank=16)


def test_an_adapter_that_does_not_fit_the_model_is_refused_with_the_shapes(tiny_checkpoints, adapter_dir):
    """q_proj's A and B saved as k_proj's, whose layer has 32 rows, not 128."""
    weights = load_file(adapter_dir / "adapter_model.safetensors")
    save_file({name.replace("q_proj", "k_proj"): tensor for name, tensor in weights.items()},
              adapter_dir / "adapter_model.safetensors")  # fmt: skip
    with LLM(str(tiny_checkpoints["llama"]), enable_lora=True) as llm:
        with pytest.raises(LoraAdapterError, match=r"k_proj is \[128, 64\] in the adapter but \[32, 64\]"):
            llm.load_lora("other", str(adapter_dir))
        assert llm.engine.core.loras.loaded() == []


@pytest.fixture(scope="module")
def qwen2_moe(tokenizer, tmp_path_factory) -> Path:
    from kvserve.testing.tiny_checkpoint import write_random_checkpoint
    from tests.test_moe_models import MOE_CONFIGS

    config = MOE_CONFIGS["qwen2_moe"](len(tokenizer))
    return write_random_checkpoint(config, tokenizer, tmp_path_factory.mktemp("lora-moe") / "qwen2_moe", seed=11)


@pytest.mark.parametrize(
    ("model", "targets"),
    [
        ("phi3", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),  # fused checkpoint modules, adapted whole
        ("qwen2_moe", ["q_proj", "v_proj", "o_proj", "shared_expert.up_proj", "shared_expert.down_proj"]),
    ],
)
def test_fused_projections_and_a_moe_models_shared_expert_match_hf_and_peft(model, targets, request, tmp_path):
    model_dir = request.getfixturevalue(model)
    adapter = write_peft_adapter(model_dir, tmp_path / "adapter", seed=3, r=8, lora_alpha=16, target_modules=targets)
    reference = build_hf_reference(model_dir, prepare_model=lambda hf_model: _load_peft(hf_model, adapter))
    with LLM(str(model_dir), enable_lora=True, lora_modules=(("a", str(adapter)),)) as llm:
        assert_matches_hf(llm, reference, "one_batch", lora_names=["a"] * len(reference))


def test_an_adapter_on_moe_experts_is_refused_by_name(adapter_dir):
    _add_module(adapter_dir, "model.layers.0.mlp.experts.0.gate_proj", in_features=64, out_features=32)
    with pytest.raises(LoraAdapterError, match="MoE experts"):
        read_peft_adapter("x", adapter_dir, max_rank=16)


def _add_module(adapter_dir: Path, module: str, in_features: int, out_features: int) -> None:
    """Add a rank-4 lora_A/lora_B pair for `module` to the adapter's weights, as PEFT names them."""
    weights_path = adapter_dir / "adapter_model.safetensors"
    weights = load_file(weights_path)
    weights[f"base_model.model.{module}.lora_A.weight"] = torch.zeros(4, in_features)
    weights[f"base_model.model.{module}.lora_B.weight"] = torch.zeros(out_features, 4)
    save_file(weights, weights_path)
