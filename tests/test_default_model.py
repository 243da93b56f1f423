"""The built-in default model, a toy trained on the King James Bible and fortune cookies and shipped in the package:
it loads with nothing downloaded or built, greets back in words, keeps the held-out perplexity its training
reached, and picks the true next verse of held-out chapters well above chance through lm-evaluation-harness."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from openai import OpenAI
from safetensors import safe_open

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.default_model import DEFAULT_MODEL_NAME, default_model_dir
from kvserve.engine.tokenizer import load_tokenizer
from tests.lm_eval_tasks import DATA_DIR, evaluate, local_completions
from tests.server_harness import running_server

MODEL_DIR = default_model_dir()
TRAINING = json.loads((MODEL_DIR / "training.json").read_text())
HELD_OUT_CHAPTERS = (
    (Path(__file__).parent / "data" / "default_model" / "held_out_chapters.txt").read_text().splitlines()
)
MAX_WEIGHT_BYTES = 8 * 1000 * 1000
NEXT_VERSE_TASK = {"kvserve_kjv_next_verse": "kjv_next_verse.yaml"}
NEXT_VERSE_DOCUMENTS = [json.loads(line) for line in (DATA_DIR / "kjv_next_verse.jsonl").read_text().splitlines()]
GROUP_SIZE = 4  # documents sharing one set of four endings


@pytest.fixture(scope="module")
def default_server():
    with running_server(kv_cache_memory_bytes=16 << 20) as running:  # no model: the built-in one
        yield running


def test_the_default_model_ships_as_a_bfloat16_checkpoint_under_8_mb_with_its_card():
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja", "README.md", "training.json"):  # fmt: skip
        assert (MODEL_DIR / name).is_file(), name
    assert (MODEL_DIR / "model.safetensors").stat().st_size <= MAX_WEIGHT_BYTES
    with safe_open(str(MODEL_DIR / "model.safetensors"), framework="pt") as weights:
        assert {str(weights.get_slice(name).get_dtype()) for name in weights.keys()} == {"BF16"}  # noqa: SIM118
    card = (MODEL_DIR / "README.md").read_text()
    assert "King James" in card and f"{TRAINING['held_out_perplexity']:.2f}" in card
    assert "<|im_start|>" in load_tokenizer(MODEL_DIR).chat_template


def test_it_answers_a_greeting_with_a_greeting_in_words(default_server):
    client = OpenAI(base_url=f"{default_server.base_url}/v1", api_key="unused")
    assert [model.id for model in client.models.list()] == [DEFAULT_MODEL_NAME]
    answer = client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=[{"role": "user", "content": "Hello"}],
                                            max_tokens=24, temperature=0, seed=0)  # fmt: skip
    text = answer.choices[0].message.content
    print(f"\nHello -> {text!r}")
    assert text.startswith("Hello!")
    words = text.split()
    assert len(words) >= 5 and all(re.fullmatch(r"[A-Za-z',.!?;:-]+", word) for word in words), text


def test_held_out_perplexity_is_what_training_reached():
    """Scored by the engine itself (prompt logprobs, float32 on the bf16 weights) on 8 held-out chapters; training
    scored 64 windows of the held-out stream, chapters too."""
    with LLM(kv_cache_memory_bytes=16 << 20) as llm:
        tokenizer = llm.engine.tokenizer
        prompts = [tokenizer.encode(line)[:512] for line in HELD_OUT_CHAPTERS]
        outputs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    logprobs = [entry.logprob for output in outputs for entry in output.prompt_logprobs[1:]]
    perplexity = math.exp(-sum(logprobs) / len(logprobs))
    print(f"\nheld-out perplexity {perplexity:.2f} over {len(logprobs)} tokens (training: "
          f"{TRAINING['held_out_perplexity']})")  # fmt: skip
    # Other windows than training's (each from a chapter's start), and bf16 weights: within a tenth of its figure,
    # and far below a random model's (about the vocabulary size).
    assert perplexity < 1.1 * TRAINING["held_out_perplexity"] < 0.1 * len(tokenizer)


def test_kvserve_generate_runs_on_it_and_says_what_it_is(tmp_path):
    result = subprocess.run(
        [sys.executable, "-P", "-m", "kvserve.server.cli", "generate", "--prompt", "In the beginning",
         "--max-tokens", "8"],
        env={**os.environ, "KVSERVE_CACHE_DIR": str(tmp_path)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "toy trained on the King James Bible" in result.stderr
    assert "1 requests, 8 tokens in" in result.stdout and "tokens/s" in result.stdout
    assert not list(tmp_path.iterdir())  # nothing built or cached on first use


def test_next_verse_documents_share_their_endings_in_fours_so_ignoring_the_context_scores_exactly_chance():
    assert len(NEXT_VERSE_DOCUMENTS) % GROUP_SIZE == 0
    for start in range(0, len(NEXT_VERSE_DOCUMENTS), GROUP_SIZE):
        group = NEXT_VERSE_DOCUMENTS[start : start + GROUP_SIZE]
        endings = sorted(group[0]["endings"])
        assert len(set(endings)) == GROUP_SIZE
        assert all(sorted(document["endings"]) == endings for document in group)
        assert sorted(document["endings"][document["label"]] for document in group) == endings


def test_lm_eval_picks_the_true_next_verse_well_above_chance_by_mutual_information(default_server, tmp_path):
    """The first 16 groups (all 292 documents: benchmarks/lm_eval_default_model.py, 53% by mutual information).
    Each ending's loglikelihood after the context, less its loglikelihood after BOS alone: how much the context
    raised it. Chance is 25%, with a standard deviation of 5.4 points over 64 documents; this run gets 62.5%."""
    lm = local_completions(default_server.base_url, DEFAULT_MODEL_NAME, MODEL_DIR, num_concurrent=2)
    scores = evaluate(lm, NEXT_VERSE_TASK, tmp_path, limit=64)["results"]["kvserve_kjv_next_verse"]
    print(f"\nnext verse, 64 documents: {scores}")
    assert scores["acc_mutual_info,none"] >= 0.5
