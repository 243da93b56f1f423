"""The offline peers the throughput benchmarks time in their own process, on one workload: kvserve's engine loop,
HF `generate` on static padded batches, and HF continuous batching."""

import time
from pathlib import Path

import torch
from transformers import GenerationConfig
from transformers.generation.continuous_batching.utils import WorkloadHints

from kvserve.engine import LLM, SamplingParams


def run_kvserve(model_dir: Path, prompts, output_lens, max_num_seqs: int):
    """Every request added at once, then `engine.step()` until all finish: the seconds, the output tokens and the
    KV slot utilisation of each step that held blocks."""
    llm = LLM(str(model_dir), max_num_seqs=max_num_seqs, kv_cache_memory_bytes=2 << 30)
    engine = llm.engine
    for prompt, output_len in zip(prompts, output_lens, strict=True):
        engine.add_request(prompt, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
    utilizations = []
    num_tokens = 0
    start_s = time.perf_counter()
    while engine.has_unfinished():
        num_tokens += sum(len(delta.token_ids) for delta in engine.step())
        usage = engine.kv_usage()
        if usage.num_used_blocks:
            utilizations.append(usage.slot_utilization)
    elapsed_s = time.perf_counter() - start_s
    return elapsed_s, num_tokens, utilizations


def run_hf_static(model, prompts, output_lens, batch_size: int, pad_token_id: int):
    """`generate` on batches in arrival order, left-padded; each batch decodes to its longest output."""
    num_tokens = 0
    start_s = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        batch, lens = prompts[first : first + batch_size], output_lens[first : first + batch_size]
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in batch])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        out = model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max(lens),
            do_sample=False,
            pad_token_id=pad_token_id,
        )
        assert out.shape[1] == width + max(lens)
        num_tokens += sum(lens)  # only the tokens each request asked for count
    return time.perf_counter() - start_s, num_tokens


def run_hf_continuous(model, prompts, output_lens, warmup: bool = False):
    """HF continuous batching (the manager behind `generate_batch`), with each request's own length.
    `warmup` captures its CUDA graphs before the clock starts."""
    config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max(output_lens))
    hints = WorkloadHints(
        max_prompt_length=max(map(len, prompts)), max_generated_length=max(output_lens), num_requests=len(prompts)
    )
    num_tokens = 0
    with model.continuous_batching_context_manager(
        generation_config=config, warmup=warmup, workload_hints=hints
    ) as manager:
        start_s = time.perf_counter()
        for prompt, output_len in zip(prompts, output_lens, strict=True):
            manager.add_request(prompt, max_new_tokens=output_len, eos_token_id=-1)
        for _ in prompts:
            result = manager.get_result(timeout=600)
            while result is not None and not result.is_finished():
                result = manager.get_result(timeout=600)
            num_tokens += len(result.generated_tokens)
        elapsed_s = time.perf_counter() - start_s
    return elapsed_s, num_tokens
