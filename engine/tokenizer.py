"""Loading a checkpoint's tokenizer and the token ids that end generation."""

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
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
