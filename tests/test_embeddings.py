"""Embeddings: a tiny Qwen3-based sentence-transformers model built with sentence-transformers itself, served by
kvserve; its vectors equal `SentenceTransformer.encode`'s (cosine >= 0.9999) for last-token and mean pooling, in
one batch of several lengths, with chunked prefill forced; no KV block is kept. Over HTTP with the `openai` SDK's
`embeddings.create` (float and base64, `dimensions` where the model allows it), and every refusal named."""

import base64
import json
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from sentence_transformers import SentenceTransformer, models

from kvserve.engine import LLM
from kvserve.engine.pooling import PoolingConfigError
from kvserve.testing.tiny_checkpoint import write_random_checkpoint
from tests.conftest import TINY_CONFIGS
from tests.server_harness import assert_nothing_allocated, assert_openai_error, running_server

TEXTS = [
    "In the beginning was the word.",
    "A cache is cut into blocks of sixteen tokens, and every block has a hash chained over the ones before it.",
    "Hi",
    "The river bends twice before it reaches the sea, and the town on its bank " * 3,
]
MIN_COSINE = 0.9999
EMBED_MODEL = "tiny-embed"


def sentence_transformer(tokenizer, root: Path, pooling: str, normalize: bool, seed: int) -> Path:
    """A sentence-transformers directory: a random tiny Qwen3 as its Transformer, then Pooling (and Normalize)."""
    checkpoint = write_random_checkpoint(TINY_CONFIGS["qwen3"](len(tokenizer)), tokenizer, root / "causal", seed=seed)
    transformer = models.Transformer(str(checkpoint))
    modules = [transformer, models.Pooling(transformer.get_word_embedding_dimension(), pooling_mode=pooling)]
    if normalize:
        modules.append(models.Normalize())
    path = root / "st"
    SentenceTransformer(modules=modules, device="cpu").save(str(path))
    return path


@pytest.fixture(scope="module")
def last_token_model(tokenizer, tmp_path_factory) -> Path:
    return sentence_transformer(tokenizer, tmp_path_factory.mktemp("embed-last"), "lasttoken", True, seed=3)


@pytest.fixture(scope="module")
def mean_model(tokenizer, tmp_path_factory) -> Path:
    return sentence_transformer(tokenizer, tmp_path_factory.mktemp("embed-mean"), "mean", False, seed=5)


def reference(model_dir: Path, texts: list[str]) -> np.ndarray:
    """sentence-transformers' own vectors, one text at a time (the tiny tokenizer has no padding token)."""
    model = SentenceTransformer(str(model_dir), device="cpu")
    model.tokenizer.pad_token = model.tokenizer.eos_token  # never used: one text, nothing to pad
    return np.stack([model.encode([text], convert_to_numpy=True)[0] for text in texts])


def assert_close(ours, expected: np.ndarray) -> None:
    ours = np.asarray(ours, dtype=np.float64)
    assert ours.shape == expected.shape
    cosines = (ours * expected).sum(-1) / np.linalg.norm(ours, axis=-1) / np.linalg.norm(expected, axis=-1)
    assert cosines.min() >= MIN_COSINE, cosines
    np.testing.assert_allclose(np.linalg.norm(ours, axis=-1), np.linalg.norm(expected, axis=-1), rtol=1e-4)


@pytest.mark.parametrize("model_fixture", ["last_token_model", "mean_model"])
@pytest.mark.parametrize("chunk_tokens", [None, 8], ids=["whole-prompts", "chunked-prefill"])
def test_vectors_equal_sentence_transformers(request, model_fixture, chunk_tokens):
    model_dir = request.getfixturevalue(model_fixture)
    with LLM(str(model_dir), kv_cache_memory_bytes=4 << 20, max_prefill_chunk_tokens=chunk_tokens) as llm:
        vectors = llm.embed(TEXTS)
        allocator = llm.engine.core.scheduler.allocator
        assert llm.engine.core.embeds and not llm.engine.core.has_unfinished()
        assert allocator.num_used_blocks == 0 and allocator.num_cached_blocks == 0  # no KV kept, none cached
    assert_close(vectors, reference(model_dir, TEXTS))


def test_a_plain_decoder_embeds_with_task_embed(tiny_checkpoints):
    with LLM(str(tiny_checkpoints["qwen3"]), task="embed", pooling="mean", normalize=True,
             kv_cache_memory_bytes=4 << 20) as llm:  # fmt: skip
        (vector,) = llm.embed(["Hello there"])
    assert abs(np.linalg.norm(vector) - 1.0) < 1e-5
    with LLM(str(tiny_checkpoints["qwen3"]), kv_cache_memory_bytes=4 << 20) as llm, pytest.raises(ValueError):
        llm.embed(["a generating engine makes no embeddings"])


def test_unsupported_sentence_transformers_modules_are_refused(last_token_model, tmp_path):
    copy = tmp_path / "with-dense"
    copy.mkdir()
    for path in last_token_model.iterdir():
        if path.is_file():
            (copy / path.name).write_bytes(path.read_bytes())
    (copy / "1_Pooling").mkdir()
    (copy / "1_Pooling" / "config.json").write_bytes((last_token_model / "1_Pooling" / "config.json").read_bytes())
    modules = json.loads((last_token_model / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (copy / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(PoolingConfigError, match="Dense"):
        LLM(str(copy), kv_cache_memory_bytes=4 << 20)
    # sentence-transformers lower-cases the text first where its config says so; kvserve does not, so refuses it.
    modules.pop()
    (copy / "modules.json").write_text(json.dumps(modules))
    st_config = json.loads((last_token_model / "sentence_bert_config.json").read_text())
    (copy / "sentence_bert_config.json").write_text(json.dumps({**st_config, "do_lower_case": True}))
    with pytest.raises(PoolingConfigError, match="do_lower_case"):
        LLM(str(copy), kv_cache_memory_bytes=4 << 20)


@pytest.fixture(scope="module")
def matryoshka_model(last_token_model, tmp_path_factory) -> Path:
    """The last-token model with vLLM's `matryoshka_dimensions` in its config.json."""
    copy = tmp_path_factory.mktemp("matryoshka") / "st"
    copy.mkdir()
    for path in last_token_model.rglob("*"):
        if path.is_file():
            target = copy / path.relative_to(last_token_model)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32, 64]}))
    return copy


@pytest.fixture(scope="module")
def live(matryoshka_model):
    with running_server(model=str(matryoshka_model), served_model_name=EMBED_MODEL, kv_cache_memory_bytes=4 << 20,
                        max_prefill_chunk_tokens=16) as running:  # fmt: skip
        yield running
        running.wait_until_idle()
        assert_nothing_allocated(running)


@pytest.fixture
def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url + "/v1", api_key="unused", max_retries=0)


def test_the_openai_sdk_gets_the_vectors_sentence_transformers_makes(client, live, matryoshka_model):
    prompt_tokens_before = live.metric("prompt_tokens_total") or 0.0
    response = client.embeddings.create(model=EMBED_MODEL, input=TEXTS)
    assert [item.index for item in response.data] == list(range(len(TEXTS)))
    assert_close([item.embedding for item in response.data], reference(matryoshka_model, TEXTS))
    assert response.model == EMBED_MODEL and response.object == "list"
    assert response.usage.prompt_tokens == response.usage.total_tokens
    live.wait_until_idle()
    assert response.usage.prompt_tokens == (live.metric("prompt_tokens_total") or 0.0) - prompt_tokens_before
    single = client.embeddings.create(model=EMBED_MODEL, input=TEXTS[0])
    assert np.allclose(single.data[0].embedding, response.data[0].embedding, atol=1e-5)


def test_base64_token_ids_and_dimensions(client, live, matryoshka_model):
    floats = client.embeddings.create(model=EMBED_MODEL, input=TEXTS[:2], encoding_format="float")
    raw = httpx.post(live.base_url + "/v1/embeddings", timeout=30,
                     json={"model": EMBED_MODEL, "input": TEXTS[:2], "encoding_format": "base64"}).json()  # fmt: skip
    decoded = [np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4") for item in raw["data"]]
    assert np.allclose(decoded, [item.embedding for item in floats.data], atol=1e-6)
    model = SentenceTransformer(str(matryoshka_model), device="cpu")
    model.tokenizer.pad_token = model.tokenizer.eos_token
    ids = model.tokenize([TEXTS[0]])["input_ids"][0].tolist()  # as sentence-transformers renders the text
    by_ids = client.embeddings.create(model=EMBED_MODEL, input=[ids])
    assert np.allclose(by_ids.data[0].embedding, floats.data[0].embedding, atol=1e-5)
    cut = client.embeddings.create(model=EMBED_MODEL, input=TEXTS[:2], dimensions=32)
    for short, whole in zip(cut.data, floats.data, strict=True):
        expected = torch.nn.functional.normalize(torch.tensor(whole.embedding[:32]), dim=0)
        assert np.allclose(short.embedding, expected.numpy(), atol=1e-5)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "dimensions": 20}, "dimensions"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "word " * 600}, "input"),
        ({"input": "x", "truncate": 3}, "truncate"),
        ({"input": "x", "model": "other"}, "model"),
    ],
)  # fmt: skip
def test_bad_requests_are_refused_by_name(live, body, param):
    response = httpx.post(live.base_url + "/v1/embeddings", json={"model": EMBED_MODEL, **body}, timeout=30)
    assert_openai_error(response, 404 if param == "model" else 400, param)


def test_an_embedding_server_generates_nothing(live):
    for route, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                        ("/v1/completions", {"prompt": "Hi"}), ("/v1/responses", {"input": "Hi"})):  # fmt: skip
        response = httpx.post(live.base_url + route, json={"model": EMBED_MODEL, **body}, timeout=30)
        assert_openai_error(response, 400, "model")


def test_a_generating_server_makes_no_embeddings(server):
    response = httpx.post(server.base_url + "/v1/embeddings", json={"model": "tiny-llama", "input": "Hi"}, timeout=30)
    assert_openai_error(response, 400, "model")
