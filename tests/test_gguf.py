"""GGUF files made by llama.cpp's own converter and llama-quantize (tests/data/gguf/, made by
`python -P -m kvserve.testing.gguf_fixtures`): the engine's greedy tokens and logprobs equal HF transformers' loading
the same file (which dequantizes it) on every scheduling path, for every tensor type kvserve runs; weights stay
quantized in memory; what kvserve cannot run is refused at start-up by name.

Logprobs within 1e-4, as for unquantized checkpoints: the weights are widened bit for bit as HF widens them
(tests/test_block_quant.py: the reference equals the `gguf` package's dequantizers, the C++ kernels the
reference), so the results differ only by the order of float32 sums, as the dense path's do.
"""

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.gguf_checkpoint import GgufError, GgufFile, hf_row_order
from kvserve.engine.models.layers import QuantizedEmbedding, weight_bytes
from kvserve.engine.parallel.sharding import TensorParallelError
from kvserve.engine.tokenizer import load_tokenizer
from kvserve.kernels.cpu_extension import load_cpu_kernels
from kvserve.testing.tiny_checkpoint import CHAT_TEMPLATE
from tests.test_parity import (
    NUM_NEW_TOKENS,
    SCHEDULING_PATHS,
    assert_matches_hf,
    assert_prefix_cached_run_matches_hf,
    build_hf_reference,
    recorded_graph_replays,
)

GGUF_DIR = Path(__file__).parent / "data" / "gguf"
# Every type kvserve runs: Q8_0; Q4_K_M's Q4_K and Q6_K (and llama's reordered q/k rows); F16, BF16, Q4_0, Q5_0 and
# a Q4_0 embedding in the mixed file; Qwen3's q/k norms and a quantized embedding that is also the LM head.
FILES = ["qwen2-q8_0.gguf", "qwen2-q4_k_m.gguf", "qwen2-mixed.gguf", "llama-q4_k_m.gguf", "qwen3-q8_0.gguf"]


def kv_block_bytes(path: Path) -> int:
    """Bytes of one 16-token KV block of the file's model in float32 (the scheduling paths' budgets are in
    blocks of the parity models)."""
    config = GgufFile(path).reader
    arch = config.get_field("general.architecture").contents()
    layers = config.get_field(f"{arch}.block_count").contents()
    kv_heads = config.get_field(f"{arch}.attention.head_count_kv").contents()
    head_dim = config.get_field(f"{arch}.attention.key_length").contents()
    return 2 * layers * 16 * kv_heads * head_dim * 4


def scheduling_paths(path: Path) -> dict[str, dict]:
    """The parity paths, with KV budgets of the same number of blocks (10) for this model's blocks."""
    blocks = {key: value for key, value in SCHEDULING_PATHS.items()}
    for name, settings in blocks.items():
        if "kv_cache_memory_bytes" in settings:
            blocks[name] = {**settings, "kv_cache_memory_bytes": 10 * kv_block_bytes(path)}
    return blocks


@pytest.fixture(scope="module", params=FILES)
def gguf_file(request) -> Path:
    return GGUF_DIR / request.param


@pytest.fixture(scope="module")
def hf_reference(gguf_file):
    return build_hf_reference(gguf_file.parent, gguf_file=gguf_file.name)


@pytest.mark.parametrize("path", sorted(SCHEDULING_PATHS))
def test_greedy_tokens_and_logprobs_match_hf(gguf_file, hf_reference, path):
    with LLM(str(gguf_file), **scheduling_paths(gguf_file)[path]) as llm:
        assert_matches_hf(llm, hf_reference, path)


def test_torch_backend_matches_hf(gguf_file, hf_reference):
    """The torch path (the reference kernels, as on a device without kvserve's kernels)."""
    settings = scheduling_paths(gguf_file)["chunked_preempting"]
    with LLM(str(gguf_file), attention_backend="torch", **settings) as llm:
        assert_matches_hf(llm, hf_reference, "chunked_preempting")


def test_prefix_cached_run_matches_hf(gguf_file, hf_reference):
    assert_prefix_cached_run_matches_hf(gguf_file, hf_reference)


@pytest.fixture(scope="module")
def dense_twin(gguf_file, tmp_path_factory) -> Path:
    """The file as HF dequantizes it, saved as an ordinary float32 checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("dense") / gguf_file.stem
    options = {"gguf_file": gguf_file.name}
    loaded = AutoModelForCausalLM.from_pretrained(gguf_file.parent, dtype=torch.float32, **options)
    config = loaded.config
    del config.quantization_config  # transformers will not save a model it loaded from GGUF: a plain copy is saved
    config.architectures = [type(loaded).__name__]
    dense = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    dense.load_state_dict(loaded.state_dict())
    dense.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf_file.parent, **options).save_pretrained(out)
    return out


def test_int8_kv_cache_gives_the_dense_twins_tokens(gguf_file, dense_twin, hf_reference):
    """INT8 KV over quantized weights: the tokens and logprobs of the same model with dense weights and INT8 KV.
    The weights' float32 sums in another order may move a KV value across an INT8 rounding edge (a step of 1/127
    of its row's largest value), which moved logprobs by up to 1.4e-3 here: they agree within 5e-3, and the
    tokens up to the first step where the dense run's two likeliest tokens are closer than that (a near tie, which
    such a step may turn)."""
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [reference[0] for reference in hf_reference]
    runs = []
    for model in (gguf_file, dense_twin):
        with LLM(str(model), kv_cache_dtype="int8", **SCHEDULING_PATHS["staggered"]) as llm:
            runs.append(llm.generate(prompts, params))
    compared = 0
    for quantized, dense in zip(*runs, strict=True):
        for ours, theirs in zip(quantized.logprobs, dense.logprobs, strict=True):
            assert ours.logprob == pytest.approx(theirs.logprob, abs=5e-3)
            (_, best), (_, second) = theirs.top_logprobs
            if best - second < 5e-3:
                break
            assert ours.token_id == theirs.token_id
            compared += 1
    assert compared >= len(prompts) * NUM_NEW_TOKENS * 3 // 4


def test_directory_holding_one_gguf_file_loads(tmp_path):
    (tmp_path / "model.gguf").symlink_to(GGUF_DIR / "qwen2-q8_0.gguf")
    with LLM(str(tmp_path)) as llm:
        assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids


def test_tokenizer_and_chat_template_come_from_the_file():
    with LLM(str(GGUF_DIR / "qwen2-q4_k_m.gguf")) as llm:
        tokenizer = llm.engine.tokenizer
        assert tokenizer.chat_template == CHAT_TEMPLATE
        assert tokenizer.decode(tokenizer.encode("In the beginning God created")).endswith(
            "In the beginning God created"
        )


def test_weights_stay_quantized_in_memory():
    """Resident weight bytes within 10% of the file's tensor bytes: each quantized tensor is held as its bytes,
    once (the tied embedding and LM head share theirs), no dense copy beside it."""
    for name in ("qwen2-q4_k_m.gguf", "qwen3-q8_0.gguf", "qwen2-mixed.gguf"):
        path = GGUF_DIR / name
        with LLM(str(path)) as llm:
            model = llm.engine.core.runner.worker.model
            assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
            file_bytes = GgufFile(path).tensor_bytes()
            assert file_bytes * 0.9 <= weight_bytes(model) <= file_bytes * 1.1, name


def _write_gguf(path: Path, arch: str, tensor_type) -> Path:
    """A file with the `gguf` package's own writer, for the refusals only (the fidelity files are llama.cpp's)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    data = np.zeros((4, 32), dtype=np.float32)
    if tensor_type is not gguf.GGMLQuantizationType.F32:
        data = gguf.quants.quantize(data, tensor_type)
    writer.add_tensor("token_embd.weight", data, raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_tensor_types_are_refused_by_name(tmp_path):
    path = _write_gguf(tmp_path / "q4_1.gguf", "qwen2", gguf.GGMLQuantizationType.Q4_1)
    with pytest.raises(GgufError, match="type Q4_1, which kvserve does not compute on"):
        LLM(str(path))


def test_unsupported_architectures_are_refused_by_name(tmp_path):
    path = _write_gguf(tmp_path / "gemma.gguf", "gemma2", gguf.GGMLQuantizationType.F32)
    with pytest.raises(GgufError, match="GGUF architecture 'gemma2' is not supported"):
        LLM(str(path))


def test_truncated_file_is_refused(tmp_path):
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes((GGUF_DIR / "qwen2-q8_0.gguf").read_bytes()[:200_000])
    with pytest.raises(GgufError, match="cannot be read as GGUF"):
        LLM(str(truncated))


def test_directory_with_several_gguf_files_asks_for_one(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).symlink_to(GGUF_DIR / "qwen2-q8_0.gguf")
    with pytest.raises(GgufError, match="several GGUF files"):
        LLM(str(tmp_path))


def test_kvserve_serve_a_gguf_file_to_the_openai_client(tmp_path):
    """`kvserve serve model.gguf`: the file's chat template shapes a chat, a JSON schema constrains the answer, and
    the start-up log names the format, its types and the bytes held."""
    import openai

    from tests.test_server_process import assert_answers_within_a_json_schema, serve_process

    path = GGUF_DIR / "qwen2-q4_k_m.gguf"
    with serve_process(path, tmp_path, "--served-model-name", "tiny-gguf") as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
        assert [model.id for model in client.models.list()] == ["tiny-gguf"]
        messages = [{"role": "user", "content": "Who created the heaven?"}]
        chat = client.chat.completions.create(model="tiny-gguf", messages=messages, max_tokens=5)
        templated = load_tokenizer(path).apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert templated.startswith("<|im_start|>user\nWho created the heaven?<|im_end|>")
        assert chat.usage.prompt_tokens == len(load_tokenizer(path)(templated, add_special_tokens=False).input_ids)
        assert_answers_within_a_json_schema(server, "tiny-gguf")
        log = server.log()
    assert "GGUF qwen2-q4_k_m.gguf (qwen2): tensors 11 f32, 13 q4_k, 3 q6_k; weights held in" in log, log


def test_kvserve_serve_refuses_an_unsupported_gguf_file_with_one_line(tmp_path):
    from tests.test_server_process import refusal_of

    path = _write_gguf(tmp_path / "q4_1.gguf", "qwen2", gguf.GGMLQuantizationType.Q4_1)
    assert "Q4_1" in refusal_of(path, tmp_path)


@pytest.mark.parametrize("name", ["qwen2-q8_0.gguf", "qwen2-mixed.gguf", "qwen3-q8_0.gguf"])
def test_two_ranks_give_hf_tokens_batched_chunked_and_preempting(name):
    """Each rank holds its rows of the column-parallel weights and whole blocks of the row-parallel ones' rows."""
    path = GGUF_DIR / name
    reference = build_hf_reference(path.parent, gguf_file=path.name)
    settings = {"max_num_seqs": 4, "max_num_batched_tokens": 20, "kv_cache_memory_bytes": 5 * kv_block_bytes(path)}
    with LLM(str(path), tensor_parallel_size=2, **settings) as llm:
        assert llm.engine.core.model.plan.size == 2
        assert_matches_hf(llm, reference, "chunked_preempting")


def test_a_split_through_quantized_blocks_is_refused_before_any_rank_starts():
    """The Q4_K_M file's attn_output rows are 256 values, one Q4_K block: two ranks cannot share it."""
    with pytest.raises(TensorParallelError, match=r"does not split blk\.0\.attn_output\.weight of qwen2-q4_k_m\.gguf"):
        LLM(str(GGUF_DIR / "qwen2-q4_k_m.gguf"), tensor_parallel_size=2)


@pytest.mark.skipif(not load_cpu_kernels(), reason="the eager replay reads device buffers only with the C++ kernels")
def test_decode_graphs_replayed_over_quantized_weights_give_hf_tokens(hf_reference, gguf_file):
    """The decode ladder captured over the quantized layers (replayed eagerly here, as CUDA graphs on GPUs): padded
    batches run the same kernels on the same bytes, and the tokens are HF's."""
    with LLM(str(gguf_file), eager_graph_replay=True, max_num_seqs=4) as llm:
        replays = recorded_graph_replays(llm)
        assert_matches_hf(llm, hf_reference, "staggered")
    assert replays


def test_llama_rows_are_put_back_for_weights_and_biases():
    """llama.cpp's converter interleaves each head's two rotary halves in q and k, biases too (the llama file above
    covers weights end to end); the loader's reordering is its inverse on both shapes."""

    def interleaved(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:  # the converter's reordering
        shape = tensor.shape
        return tensor.reshape(num_heads, 2, shape[0] // num_heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)

    weight, bias = torch.randn(16, 8), torch.randn(16)
    assert torch.equal(hf_row_order(interleaved(weight, 2), 2), weight)
    assert torch.equal(hf_row_order(interleaved(bias, 4), 4), bias)
