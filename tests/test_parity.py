"""The engine's greedy tokens and logprobs equal HF transformers' for the same checkpoint."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams

NUM_NEW_TOKENS = 12


def _prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    lengths = [1, 3, 9, 16, 17, 31, 48, 70]  # below, at and across block boundaries
    return [torch.randint(4, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def _hf_greedy(model_dir, prompt: list[int]) -> tuple[list[int], list[float]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    # Without an EOS, HF neither stops early nor masks EOS (as min_new_tokens would): like ignore_eos.
    model.generation_config.eos_token_id = None
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=NUM_NEW_TOKENS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens, strict=True)]
    return tokens, logprobs


def test_batched_greedy_matches_hf_generate_per_prompt(tiny_model):
    vocab_size = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    prompts = _prompts(vocab_size)
    llm = LLM(str(tiny_model), kv_cache_memory_bytes=4 << 20)
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs, strict=True):
        expected_tokens, expected_logprobs = _hf_greedy(tiny_model, prompt)
        assert output.token_ids == expected_tokens
        got_logprobs = [entry.logprob for entry in output.logprobs]
        assert got_logprobs == pytest.approx(expected_logprobs, abs=1e-4)
