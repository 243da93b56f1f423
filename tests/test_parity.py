"""The engine's greedy tokens and logprobs equal HF transformers' for the same checkpoint, on every
scheduling path: one batch, staggered admission (prefill and decode mixed in a step), and preemption."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvserve.engine import LLM, SamplingParams
from kvserve.kernels.cpu_extension import load_cpu_kernels

NUM_NEW_TOKENS = 12
PROMPT_LENGTHS = [1, 3, 9, 16, 17, 31, 48, 70]  # below, at and across block boundaries

SCHEDULING_PATHS = {
    "one_batch": {},
    # At most 3 running: new prompts are prefilled in the same steps as others decode.
    "staggered": {"max_num_seqs": 3},
    # 10 blocks of 16 tokens (8 KiB each for these models) cannot hold the batch: forces preemption.
    "preempting": {"kv_cache_memory_bytes": 10 * 8192},
    # 24 tokens a step, at most 7 per prefill chunk: prompts are computed over many steps, beside decodes.
    "chunked": {"max_num_batched_tokens": 24, "max_prefill_chunk_tokens": 7},
    # Whole prompts only (the budget covers the 512-token context).
    "unchunked": {"enable_chunked_prefill": False},
    # Chunks and preemption together.
    "chunked_preempting": {"max_num_batched_tokens": 20, "kv_cache_memory_bytes": 10 * 8192},
}


def _prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(4, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def hf_reference(tiny_model):
    return build_hf_reference(tiny_model)


def build_hf_reference(model_dir: Path, prepare_model=None, **load_options) -> list:
    """Prompts, HF `generate` greedy tokens and logprobs, and the prompt's logprobs, each prompt run alone.
    `load_options` go to `from_pretrained` (a GGUF file's name: `gguf_file`); `prepare_model`, if given, is called
    with the loaded model before it runs."""
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", **load_options
    )
    if prepare_model is not None:
        prepare_model(model)
    vocab_size = model.config.vocab_size
    # Without an EOS, HF neither stops early nor masks EOS (as min_new_tokens would): like ignore_eos.
    model.generation_config.eos_token_id = None
    reference = []
    for prompt in _prompts(vocab_size):
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NUM_NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        tokens = out.sequences[0, len(prompt) :].tolist()
        logprobs = [torch.log_softmax(step[0], -1)[t].item() for step, t in zip(out.logits, tokens, strict=True)]
        with torch.no_grad():
            prompt_scores = torch.log_softmax(model(torch.tensor([prompt])).logits[0], -1)
        prompt_logprobs = [prompt_scores[p, prompt[p + 1]].item() for p in range(len(prompt) - 1)]
        reference.append((prompt, tokens, logprobs, prompt_logprobs))
    return reference


@pytest.mark.parametrize("path", sorted(SCHEDULING_PATHS))
def test_greedy_tokens_and_logprobs_match_hf(tiny_model, hf_reference, path):
    llm = LLM(str(tiny_model), **SCHEDULING_PATHS[path])
    assert llm.engine.core.runner.worker.backend.name == ("cpu" if load_cpu_kernels() else "torch")
    assert_matches_hf(llm, hf_reference, path)


def test_torch_backend_matches_hf(tiny_model, hf_reference):
    """The pure torch path, the engine's fallback where the C++ kernels cannot be built."""
    llm = LLM(str(tiny_model), attention_backend="torch", **SCHEDULING_PATHS["chunked_preempting"])
    assert llm.engine.core.runner.worker.backend.name == "torch"
    assert_matches_hf(llm, hf_reference, "chunked_preempting")


def test_triton_backend_matches_hf(tiny_model, hf_reference):
    """The Triton kernels in the engine (in the interpreter on a CPU): decodes beside prompt chunks
    that attend to earlier chunks, and recomputation after preemption."""
    llm = LLM(str(tiny_model), attention_backend="triton", dtype="float32", **SCHEDULING_PATHS["chunked_preempting"])
    assert llm.engine.core.runner.worker.backend.name == "triton"
    assert_matches_hf(llm, hf_reference, "chunked_preempting")


def assert_matches_hf(
    llm: LLM, hf_reference, path: str, logprob_tolerance: float = 1e-4, lora_names: list[str | None] | None = None
) -> None:
    """Every other request also scores its prompt (prompt logprobs), so both kinds share the batches. `lora_names`:
    the LoRA adapter each prompt runs under (the reference's, prompt by prompt)."""
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    scoring = replace(params, prompt_logprobs=1)
    outputs = llm.generate([reference[0] for reference in hf_reference],
                           [scoring if i % 2 else params for i in range(len(hf_reference))], lora_names)  # fmt: skip

    for i, ((prompt, tokens, logprobs, prompt_logprobs), output) in enumerate(zip(hf_reference, outputs, strict=True)):
        assert output.token_ids == tokens
        assert [entry.logprob for entry in output.logprobs] == pytest.approx(logprobs, abs=logprob_tolerance)
        if i % 2 == 0:
            assert output.prompt_logprobs is None
            continue
        first, *scored = output.prompt_logprobs
        assert first is None
        assert [entry.token_id for entry in scored] == prompt[1:]
        assert [entry.logprob for entry in scored] == pytest.approx(prompt_logprobs, abs=logprob_tolerance)
    if "preempting" in path:
        assert llm.engine.core.scheduler.num_preemptions > 0
    assert llm.engine.kv_usage().num_used_blocks == 0


def recorded_graph_replays(llm: LLM) -> list[int]:
    """The batch sizes of the decode graphs the engine replays from now on, in order (a list it appends to)."""
    replays = []
    for size, graph in llm.engine.core.runner.worker.decode_graphs.graphs.items():
        replay = graph.replay
        graph.replay = lambda size=size, replay=replay: replays.append(size) or replay()
    return replays


def assert_prefix_cached_run_matches_hf(
    model_dir: Path, hf_reference, logprob_tolerance: float = 1e-4, **settings
) -> None:
    """The parity prompts twice on one engine: the second run's full blocks come from the prefix cache."""
    with LLM(str(model_dir), enable_prefix_caching=True, **settings) as llm:
        assert_matches_hf(llm, hf_reference, "one_batch", logprob_tolerance)
        assert_matches_hf(llm, hf_reference, "one_batch", logprob_tolerance)
        assert llm.engine.core.scheduler.prefix_cache_hit_tokens > 0
