"""Loading a checkpoint's tokenizer and the token ids that end generation."""

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kvserve.engine.gguf_checkpoint import find_gguf
from kvserve.engine.gguf_checkpoint import load_tokenizer as load_gguf_tokenizer


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer; a GGUF file's from its metadata (with its chat template)."""
    gguf_path = find_gguf(model_dir)
    if gguf_path is not None:
        return load_gguf_tokenizer(gguf_path)
    return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)


def eos_token_ids(model_dir: str | Path, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """EOS ids from generation_config.json (an int or a list) and from the tokenizer."""
    ids: set[int] = set()
    generation_config = Path(model_dir) / "generation_config.json"
    if generation_config.exists():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
