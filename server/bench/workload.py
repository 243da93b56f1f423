"""The requests a benchmark sends: random prompts or prompts from a file, each with its output length, seeded.

Random prompts are words from a fixed list (about one token per word for common tokenizers) or, given a
tokenizer, exactly `input_len` tokens, as vLLM's random dataset makes them: random token ids decoded to text,
re-encoded, and cut or topped up until the text encodes to the wanted length.
"""

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from kvserve.server.bench.errors import BenchError

# Decoding random ids and encoding the text again rarely gives the same count at once (tokens merge at their
# joins); a few rounds of cutting or topping up settle it. vLLM's random dataset allows 10 as well.
MAX_LENGTH_TRIES = 10
# Common English words: most tokenizers have one token for each.
_WORD_TEXT = (
    "the of and to in is that it was for on are as with his they at be this from have or by one had not but what "
    "all were when we there can an your which their said if do will each about how up out them then she many some "
    "so these would other into has more her two like him see time could no make than first been its who now people "
    "my made over did down only way find use may water long little very after words called just where most know "
    "get through back much before go good new write our used me man too any day same right look think also around "
    "another came come work three word must because does part even place well such here take why things help put "
    "years different away again off went old number great tell men say small every found still between name "
    "should home big give air line set own under read last never us left end along while might next sound below "
    "saw something thought both few those always looked show large often together asked house world going want "
    "school important until form food keep children feet land side without boy once animals life enough took "
    "sometimes four head above kind began almost live page got earth need far hand high year mother light parts "
    "country father let night following picture being study second eyes soon times story boys since white days "
    "ever paper hard near sentence better best across during today others however sure means knew it's try told "
    "young miles sun ways thing whole hear example heard several change answer room sea against top turned learn "
    "point city play toward five using himself usually"
)
WORDS = _WORD_TEXT.split()


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    output_len: int  # sent as max_tokens; with ignore_eos the server generates exactly this many


def length_bounds(mean: int, range_ratio: float) -> tuple[int, int]:
    """Lengths are drawn uniformly from [floor(mean * (1 - r)), ceil(mean * (1 + r))], at least 1 (as vLLM)."""
    low = max(1, math.floor(mean * (1 - range_ratio)))
    return low, max(low, math.ceil(mean * (1 + range_ratio)))


def random_requests(
    num_prompts: int, input_len: int, output_len: int, range_ratio: float, seed: int, tokenizer_path: str | None
) -> list[BenchRequest]:
    rng = random.Random(seed)
    if tokenizer_path is None:
        make_prompt, num_special = _word_prompt, 0
    else:
        # The server adds the tokenizer's special tokens (a BOS) to each prompt; leave room for them, as vLLM
        # does, so the prompt the model sees is `input_len` tokens.
        token_prompts = _TokenPrompts(tokenizer_path)
        make_prompt, num_special = token_prompts, token_prompts.num_special_tokens
    input_bounds = length_bounds(max(1, input_len - num_special), range_ratio)
    output_bounds = length_bounds(output_len, range_ratio)
    requests = []
    for _ in range(num_prompts):
        prompt_len = rng.randint(*input_bounds)
        requests.append(BenchRequest(make_prompt(prompt_len, rng), rng.randint(*output_bounds)))
    return requests


def file_requests(path: str, num_prompts: int, output_len: int, range_ratio: float, seed: int) -> list[BenchRequest]:
    """Prompts in file order, repeated if the file has fewer than `num_prompts`; output lengths drawn as above."""
    prompts = read_prompts(Path(path))
    rng = random.Random(seed)
    output_bounds = length_bounds(output_len, range_ratio)
    return [BenchRequest(prompts[i % len(prompts)], rng.randint(*output_bounds)) for i in range(num_prompts)]


def read_prompts(path: Path) -> list[str]:
    """A .jsonl file: one object with a "prompt" string per line; any other file: one prompt per line."""
    try:
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as error:
        raise BenchError(f"cannot read prompts from {path}: {error}") from error
    if path.suffix == ".jsonl":
        lines = [_jsonl_prompt(path, number, line) for number, line in enumerate(lines, 1)]
    prompts = lines
    if not prompts:
        raise BenchError(f"no prompts in {path}")
    return prompts


def _jsonl_prompt(path: Path, number: int, line: str) -> str:
    try:
        prompt = json.loads(line).get("prompt")
    except (json.JSONDecodeError, AttributeError) as error:
        raise BenchError(f"{path}:{number}: not a JSON object") from error
    if not isinstance(prompt, str) or not prompt:
        raise BenchError(f'{path}:{number}: no "prompt" string')
    return prompt


def _word_prompt(num_words: int, rng: random.Random) -> str:
    return " ".join(rng.choices(WORDS, k=num_words))


class _TokenPrompts:
    """Prompts of an exact token count under one HF tokenizer (its tokenizer.json)."""

    def __init__(self, tokenizer_path: str) -> None:
        from tokenizers import Tokenizer  # only with --tokenizer: the word prompts need nothing

        path = Path(tokenizer_path)
        file = path / "tokenizer.json" if path.is_dir() else path
        try:
            self.tokenizer = Tokenizer.from_file(str(file))
        except Exception as error:  # tokenizers raises a bare Exception for a missing or malformed file
            raise BenchError(f"cannot load a tokenizer from {file}: {error}") from error
        self.allowed_ids = self._round_trip_ids()
        self.num_special_tokens = len(self.tokenizer.encode("", add_special_tokens=True).ids)

    def _round_trip_ids(self) -> list[int]:
        """The ordinary tokens that decode to text encoding back to themselves. Byte-level vocabularies hold
        pieces of characters that decode to U+FFFD, which encodes to other tokens: with those, cutting and
        topping up a prompt to its length often does not settle."""
        special_ids = {i for i, token in self.tokenizer.get_added_tokens_decoder().items() if token.special}
        candidates = [i for i in range(self.tokenizer.get_vocab_size()) if i not in special_ids]
        texts = self.tokenizer.decode_batch([[i] for i in candidates])
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        allowed = [i for i, text, encoding in zip(candidates, texts, encodings, strict=True)
                   if encoding.ids == [i] and "\ufffd" not in text]  # fmt: skip
        if not allowed:
            raise BenchError("the tokenizer has no token that decodes and encodes back to itself")
        return allowed

    def __call__(self, num_tokens: int, rng: random.Random) -> str:
        token_ids = rng.choices(self.allowed_ids, k=num_tokens)
        for _ in range(MAX_LENGTH_TRIES):
            text = self.tokenizer.decode(token_ids)
            token_ids = self.tokenizer.encode(text, add_special_tokens=False).ids
            if len(token_ids) == num_tokens:
                return text
            token_ids = token_ids[:num_tokens] + rng.choices(self.allowed_ids, k=max(0, num_tokens - len(token_ids)))
        # Still off by a token or two: the server's usage reports the exact count, which is what the summary shows.
        return self.tokenizer.decode(token_ids)
