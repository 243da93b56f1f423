"""The step path: inputs in persistent buffers, block tables grown in place, one transfer back per
step, and padded decode batches replayed through captured graphs."""

import random

import numpy as np
import pytest
import torch

from kvserve.engine import LLM, SamplingParams
from kvserve.engine import sampler as sampler_module
from kvserve.engine.decode_graphs import capture_sizes
from kvserve.engine.kv_sizing import MemoryProbe, StepLimits, paged_kv_layers
from kvserve.engine.model_loader import load_model
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.sampler import PenaltyState, SamplingRow, sample
from kvserve.engine.step_inputs import BlockTables, host_positions_and_slots, positions_and_slots
from kvserve.engine.step_plan import StepPlanner
from kvserve.engine.worker import Worker
from kvserve.kernels import TorchBackend
from kvserve.kernels.cpu_extension import load_cpu_kernels
from kvserve.kvcache import BlockAllocator, KVCache, KVCacheSpec
from kvserve.scheduler import FinishReason, Request, ScheduledRequest, Scheduler, SchedulerConfig, SchedulerOutput
from tests.test_parity import recorded_graph_replays

META = torch.device("meta")


def test_a_step_reads_nothing_back_from_the_device_but_the_sampled_tokens(tiny_checkpoints, monkeypatch):
    """The model, its cache and every device buffer on the meta device, which holds no values: reading
    one back (.item(), .tolist(), a boolean mask, a host copy) fails there. Steps of prompt chunks,
    decodes and preemptions, with greedy, random, penalised and logprob rows, reach their one
    transfer back, which this test answers in the device's place. (The torch backend stands in for
    the C++ and Triton kernels, which run only on their own devices.)"""
    model = load_model(tiny_checkpoints["qwen3"], torch.float32, META)
    config = model.config
    spec = KVCacheSpec(config.num_layers, config.num_kv_heads, config.head_dim, torch.float32, block_size=16)
    num_blocks = 8
    worker = Worker(
        model, KVCache.allocate(spec, num_blocks, META), TorchBackend(), StepLimits(512, 40), max_num_seqs=6,
        device=META,
    )  # fmt: skip
    runner = ModelRunner(worker, max_num_seqs=6)
    scheduler_config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=40, enable_chunked_prefill=True)
    scheduler = Scheduler(scheduler_config, BlockAllocator(num_blocks), 16)
    transfers = []

    def to_host(tensors):
        assert all(tensor.device == META for tensor in tensors)
        transfers.append([tuple(tensor.shape) for tensor in tensors])
        return [torch.full(tensor.shape, 7, dtype=tensor.dtype) for tensor in tensors]

    monkeypatch.setattr(sampler_module, "to_host", to_host)
    rng = random.Random(0)
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, logprobs=3),
        SamplingParams(temperature=1.0, frequency_penalty=0.2),
    ]
    rows = {}
    for i in range(9):
        request_id = str(i)
        prompt = [rng.randrange(4, config.vocab_size) for _ in range(rng.randint(3, 60))]
        scheduler.add(Request(request_id=request_id, prompt_token_ids=prompt))
        params = kinds[i % len(kinds)]
        penalties = PenaltyState.of(prompt, config.vocab_size, META) if params.has_penalties else None
        rows[request_id] = SamplingRow(params, None, penalties, banned_token_ids=(1, 2) if i == 3 else ())
    num_steps = 0
    while scheduler.num_unfinished and num_steps < 200:
        output = scheduler.schedule()
        logits = runner.execute(output)
        sampling = [rows[item.request.request_id] for item in output.scheduled if item.samples_next_token]
        tokens = sample(logits, sampling).token_ids
        assert len(transfers) == num_steps + 1  # one transfer back, at the end of sampling
        scheduler.update(output, tokens)
        for item in output.scheduled:
            if len(item.request.output_token_ids) >= 20:
                scheduler.finish(item.request, FinishReason.LENGTH)
        num_steps += 1
    assert not scheduler.num_unfinished
    assert scheduler.num_preemptions > 0  # 8 blocks of 16 tokens cannot hold six requests of up to 80 tokens
    assert any(len(shapes) == 4 for shapes in transfers)  # token ids, sampled logprobs, top values, top ids


def test_block_table_rows_grow_in_place_and_rows_are_reused():
    """Rank 0's planner gives each running request a row and sends only the blocks added since the last step; a
    rank's tables, written from those entries alone, hold every request's blocks."""
    planner = StepPlanner(max_num_seqs=3, long_rope=False)
    table = BlockTables(max_num_seqs=3, max_blocks_per_seq=4, padding_block=99, device=torch.device("cpu"))
    first = Request(request_id="a", prompt_token_ids=[1], block_ids=[5])
    second = Request(request_id="b", prompt_token_ids=[1], block_ids=[7, 8])

    def step(*requests: Request, left_running: tuple[str, ...] = ()) -> tuple[list[int], int]:
        output = SchedulerOutput([ScheduledRequest.of(r, 1) for r in requests], left_running=list(left_running))
        plan = planner.plan(output)
        table.write(plan.table_entries)
        return plan.rows.tolist(), plan.table_entries.shape[1]

    (row_a, row_b), num_entries = step(first, second)
    assert row_a != row_b and table.padding_row not in (row_a, row_b) and num_entries == 3
    first.block_ids += [9, 11]
    assert step(first, second) == ([row_a, row_b], 2)  # the two new blocks only
    assert table.device_table[row_a, :3].tolist() == [5, 9, 11]
    assert table.device_table[row_b, :2].tolist() == [7, 8]
    assert table.device_table[table.padding_row].tolist() == [99] * 4
    third = Request(request_id="c", prompt_token_ids=[1], block_ids=[3])
    assert step(third, left_running=("a",)) == ([row_a], 1)  # the freed row, rewritten from its first block
    assert table.device_table[row_a, 0].item() == 3


def test_padded_decode_graphs_give_the_eager_tokens(tiny_checkpoints):
    """Decode steps padded to a ladder of sizes and replayed (eagerly here, as CUDA graphs on a GPU):
    batches that shrink as requests finish and grow as new ones join, between prompt chunks that run
    eagerly. Padding rows write only the padding block, so every request's tokens are the eager
    engine's."""
    # Checked here, not in a skipif: collecting this module on the GPU machine (benchmarks/gpu_check.sh) must not
    # build the C++ CPU kernels, which it has no use for.
    if torch.cuda.is_available():
        pytest.skip("a GPU replays real CUDA graphs (test_cuda_graphs_give_the_eager_tokens)")
    if not load_cpu_kernels():
        pytest.skip("the eager replay reads device buffers only with the C++ kernels")
    model_dir = str(tiny_checkpoints["llama"])
    prompts = [[4 + (7 * i + j) % 300 for j in range(5 + 9 * i)] for i in range(7)]
    params = [SamplingParams(max_tokens=6 + 5 * i, temperature=0.0, ignore_eos=True, logprobs=0) for i in range(7)]
    settings = {"max_num_seqs": 5, "max_num_batched_tokens": 32}
    expected = LLM(model_dir, **settings).generate(prompts, params)

    llm = LLM(model_dir, eager_graph_replay=True, **settings)
    graphs = llm.engine.core.runner.worker.decode_graphs
    assert sorted(graphs.graphs) == [1, 2, 4, 5]
    replays = recorded_graph_replays(llm)
    padding_block = llm.engine.core.kv_cache.padding_block
    outputs = llm.generate(prompts, params)

    assert {3, 4, 5} & set(replays)  # batches of 3 padded to 4, and more, were replayed
    for got, want in zip(outputs, expected, strict=True):
        assert got.token_ids == want.token_ids
        assert [e.logprob for e in got.logprobs] == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4)
    assert llm.engine.kv_usage().num_used_blocks == 0
    assert llm.engine.core.kv_cache.key_caches[0][padding_block].abs().sum() > 0  # padding rows wrote there


def test_capture_sizes_ladder():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_warm_up_runs_a_chunk_and_a_mixed_step_in_the_padding_block_alone(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["llama"]), kv_cache_memory_bytes=1 << 20)
    cache = llm.engine.core.kv_cache
    before = [key[: cache.num_blocks].clone() for key in cache.key_caches]
    assert llm.engine.core.runner.worker.warm_up() > 0
    assert all(key[: cache.num_blocks].equal(old) for key, old in zip(cache.key_caches, before, strict=True))
    assert cache.key_caches[0][cache.padding_block].abs().sum() > 0
    # Its rows are free again: a full batch still gets one each.
    prompts = [[5 + i, 6, 7] for i in range(llm.engine.config.max_num_seqs)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert all(len(output.token_ids) == 2 for output in outputs)


def test_warm_up_of_an_engine_of_one_sequence_runs_a_lone_decode(tiny_checkpoints):
    # A mixed step needs two sequences' rows of the input buffers (the first GPU run: gpu_step_bench's batch 1).
    llm = LLM(str(tiny_checkpoints["llama"]), kv_cache_memory_bytes=1 << 20, max_num_seqs=1)
    assert llm.engine.core.runner.worker.warm_up() > 0
    output = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))[0]
    assert len(output.token_ids) == 2


def test_the_memory_probe_splits_its_prefill_into_prompts_within_the_context(tiny_checkpoints):
    probe = MemoryProbe.of(100, 40, 16)
    inputs = probe.inputs(16, torch.device("cpu"))
    metadata, positions, num_blocks = inputs.metadata, inputs.positions, probe.num_blocks
    assert metadata.query_lens_cpu == [40, 40, 20]
    assert positions.max().item() == 39 and metadata.query_start_loc.tolist() == [0, 40, 80, 100]
    assert metadata.slot_mapping.unique().numel() == 100 and metadata.slot_mapping.max().item() < num_blocks * 16
    model = load_model(tiny_checkpoints["llama"], torch.float32, torch.device("cpu"))
    spec = KVCacheSpec(model.config.num_layers, model.config.num_kv_heads, model.config.head_dim, torch.float32)
    caches = paged_kv_layers(KVCache.allocate(spec, num_blocks, torch.device("cpu")))
    hidden = model(inputs.input_ids, positions, caches, metadata, TorchBackend())
    assert hidden.shape == (100, model.config.hidden_size) and hidden.isfinite().all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (benchmarks/gpu_check.sh runs this)")
def test_cuda_graphs_give_the_eager_tokens(tiny_checkpoints):
    model_dir = str(tiny_checkpoints["qwen3"])
    prompts = [[4 + (5 * i + j) % 300 for j in range(3 + 11 * i)] for i in range(7)]
    params = [SamplingParams(max_tokens=5 + 4 * i, temperature=0.0, ignore_eos=True, logprobs=0) for i in range(7)]
    # Byte budgets: two engines are alive at once, and a share of the GPU would count the first one's cache.
    settings = {"max_num_seqs": 5, "max_num_batched_tokens": 32, "dtype": "float32", "kv_cache_memory_bytes": 1 << 24}
    eager = LLM(model_dir, enforce_eager=True, **settings)
    assert eager.engine.core.runner.worker.decode_graphs is None
    graphs = LLM(model_dir, **settings)
    assert sorted(graphs.engine.core.runner.worker.decode_graphs.graphs) == [1, 2, 4, 5]
    for got, want in zip(graphs.generate(prompts, params), eager.generate(prompts, params), strict=True):
        assert got.token_ids == want.token_ids
        assert [e.logprob for e in got.logprobs] == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4)


@pytest.mark.parametrize("long_rope", [None, (40, 1000)], ids=["plain", "long-rope"])
def test_positions_and_slots_on_the_host_equal_the_device_derivation(long_rope):
    """On a CPU the step's positions and slots are derived in NumPy; elsewhere by torch ops on the device: one
    answer for ragged chunks and decodes, with shuffled blocks (and LongRoPE's long rows)."""
    rng = np.random.default_rng(0)
    query_lens = np.array([1, 1, 7, 1, 30, 3], dtype=np.int64)
    seq_lens = np.array([5, 17, 40, 64, 30, 50], dtype=np.int64)
    block_tables = rng.permutation(6 * 4).reshape(6, 4).astype(np.int32)
    sequence_lens = seq_lens + 2
    positions, slots = host_positions_and_slots(query_lens, seq_lens, block_tables, 16, long_rope, sequence_lens)
    query_start_loc = torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32)
    num_tokens = int(query_lens.sum())
    want_positions, want_slots = positions_and_slots(
        query_start_loc, torch.from_numpy(seq_lens).int(), torch.from_numpy(block_tables), 16,
        torch.arange(num_tokens), torch.arange(6), long_rope, torch.from_numpy(sequence_lens),
    )  # fmt: skip
    assert positions.tolist() == want_positions.tolist() and slots.tolist() == want_slots.tolist()


def test_a_step_that_runs_nothing_frees_the_rows_of_requests_that_left(tiny_checkpoints):
    # Requests aborted between steps leave with the next scheduler output; when that output runs nothing, no plan
    # carries them to the planner, and their block-table rows must be freed all the same (else the next requests
    # find no row).
    llm = LLM(str(tiny_checkpoints["llama"]), max_num_seqs=2, kv_cache_memory_bytes=1 << 20)
    core = llm.engine.core
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for _ in range(3):  # with the rows of one round kept, the next round's requests would find none
        request_ids = [llm.engine.add_request([5 + i, 6, 7], params) for i in range(2)]
        assert len(core.step().scheduled.scheduled) == 2  # the prompts run: each request takes a row
        for request_id in request_ids:
            core.finish(request_id)
        assert core.step().scheduled.is_empty
