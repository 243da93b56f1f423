"""Per-request sampling and stopping settings, validated at the engine boundary."""

import math
from dataclasses import dataclass, field
from typing import Literal

from kvserve.engine.errors import InvalidRequestError

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match (structured outputs): a JSON schema (JSON text), any JSON
    object, a regular expression, one of a list of strings (JSON text of the list), or an EBNF grammar.
    `strict` (JSON schema only): properties the schema does not name are not generated. `param`: the request
    field it came from, which an error names (not part of what the grammar is: equal grammars share a build)."""

    kind: Literal["json_object", "json_schema", "regex", "choice", "grammar"]
    source: str = ""
    strict: bool = True
    param: str = field(default="structured_output", compare=False)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    `min_tokens`: until that many tokens exist, EOS and `stop_token_ids` are not sampled and stop
    strings do not stop the request.
    `temperature == 0` is greedy decoding. `top_k <= 0` and `top_p == 1` disable those filters.
    `logprobs=N` returns the sampled token's log-probability and the N most likely alternatives,
    computed from the model's raw logits (before penalties, bias and temperature).
    `prompt_logprobs=N`: the same for every prompt token after the first (a prompt's first token has
    none), computed while the prompt is prefilled; such a request never reuses cached prefix blocks.
    `logit_bias`: (token id, bias) pairs added to the logits before sampling.
    `structured_output`: only tokens that keep the output inside the grammar are sampled.
    `speculative_decoding`: False keeps this request out of speculative decoding (one token a step), where the
    engine speculates; it never changes the output.
    """

    max_tokens: int | None = 16  # None: the rest of the context window (resolved by the input processor)
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured_output: GrammarSpec | None = None
    speculative_decoding: bool = True

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self, vocab_size: int) -> None:
        """Raise `InvalidRequestError` naming the first field out of range (NaN included)."""
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("min_tokens", self.min_tokens, low=0, high=self.max_tokens)
        _check_float("temperature", self.temperature, low=0.0, high=100.0)
        _check_float("top_p", self.top_p, low=0.0, high=1.0, low_inclusive=False)
        _check_int("top_k", self.top_k, low=-1)
        _check_float("min_p", self.min_p, low=0.0, high=1.0)
        _check_float("repetition_penalty", self.repetition_penalty, low=0.0, high=100.0, low_inclusive=False)
        _check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=-(2**63), high=2**63 - 1)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)
        for token_id, bias in self.logit_bias:
            _check_int("logit_bias", token_id, low=0, high=vocab_size - 1)
            _check_float("logit_bias", bias, low=-MAX_LOGIT_BIAS, high=MAX_LOGIT_BIAS)
        if self.structured_output is not None:
            self._check_structured_output()
        if isinstance(self.stop, str):
            raise InvalidRequestError("stop", "must be a sequence of strings, not a single string")
        for stop in self.stop:
            if not isinstance(stop, str) or not stop:
                raise InvalidRequestError("stop", "stop strings must be non-empty strings")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, low=0, high=vocab_size - 1)

    def _check_structured_output(self) -> None:
        # Once the grammar is complete only a stop token may follow: a request that must not stop yet
        # would have nothing left to sample.
        if self.min_tokens:
            raise InvalidRequestError("min_tokens", "cannot be combined with structured outputs")
        if self.ignore_eos:
            raise InvalidRequestError("ignore_eos", "cannot be combined with structured outputs")


def _check_int(name: str, value, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(name, f"must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise InvalidRequestError(name, f"must be {bounds}, got {value}")


def _check_float(name: str, value, low: float, high: float, low_inclusive: bool = True) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequestError(name, f"must be a finite number, got {value!r}")
    too_low = value < low if low_inclusive else value <= low
    if too_low or value > high:
        bounds = f"[{low}, {high}]" if low_inclusive else f"({low}, {high}]"
        raise InvalidRequestError(name, f"must be in {bounds}, got {value}")
