"""The built-in default model: a small Llama checkpoint with random weights, made on first use.

It lets kvserve run with nothing downloaded. Its weights are random, so its text is gibberish;
it exists to exercise the whole stack, not to answer questions.
"""

import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

DEFAULT_MODEL_NAME = "kvserve-default-llama-v1"
RANDOM_WEIGHTS_NOTICE = (
    f"no model given: serving the built-in {DEFAULT_MODEL_NAME}, whose weights are RANDOM "
    "(its text is gibberish; pass a HF checkpoint directory for real output)"
)
_SEED = 1234
_VOCAB_SIZE = 2048


def cache_root() -> Path:
    return Path(os.environ.get("KVSERVE_CACHE_DIR", Path.home() / ".cache" / "kvserve"))


def default_model_dir() -> Path:
    """Directory of the default checkpoint, building it there first if it is missing."""
    model_dir = cache_root() / DEFAULT_MODEL_NAME
    if not (model_dir / "config.json").exists():
        _build(model_dir)
    return model_dir


def _build(model_dir: Path) -> None:
    # Imported here so merely importing the engine does not pay for the checkpoint builder.
    from transformers import LlamaConfig

    from engine.tiny_checkpoint import train_tokenizer, write_random_checkpoint

    corpus = resources.files("engine").joinpath("assets/corpus.txt").read_text(encoding="utf-8")
    tokenizer = train_tokenizer(corpus, _VOCAB_SIZE)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"],
    )
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so a half-written checkpoint is never picked up.
    staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=model_dir.parent))
    try:
        write_random_checkpoint(config, tokenizer, staging, seed=_SEED)
        try:
            staging.rename(model_dir)
        except OSError:
            if not (model_dir / "config.json").exists():  # not another process winning the race
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
