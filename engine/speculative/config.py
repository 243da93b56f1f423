"""How the engine speculates: vLLM's `speculative_config` keys for the methods kvserve has."""

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

DEFAULT_DRAFT = "default"  # `model`: the built-in model's draft, shipped in the package (for the built-in model only)

NGRAM_DEFAULTS = {"prompt_lookup_min": 2, "prompt_lookup_max": 4}
SUFFIX_DEFAULTS = {
    "suffix_decoding_max_tree_depth": 24,
    "suffix_decoding_max_cached_requests": 10000,
    "suffix_decoding_max_spec_factor": 1.0,
    "suffix_decoding_min_token_prob": 0.1,
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: "ngram" (prompt lookup: the tokens that followed the latest earlier occurrence of the request's last
        n tokens, in its prompt or output, are proposed to come next) or "suffix" (suffix decoding: the most frequent
        continuation of the longest matching suffix, in the request's text or in recent requests' outputs;
        engine/speculative/suffix_proposer.py) or "draft_model" (a smaller model with the target's vocabulary proposes
        greedily, running beside the target with its own KV cache in the target's blocks; engine/speculative/
        draft_model.py). Left out: "draft_model" when `model` is given, else "ngram".
    model (draft_model): the draft's checkpoint directory, or "default": the built-in model's draft.
    num_speculative_tokens: the most draft tokens a request verifies in one step.
    prompt_lookup_min, prompt_lookup_max (ngram): the n-gram sizes tried, longest first (default 2 and 4).
    suffix_decoding_max_tree_depth (suffix): the longest suffix matched, in tokens (default 24).
    suffix_decoding_max_cached_requests (suffix): how many finished requests' outputs are matched too (default
        10000; 0: none, only the request's own text).
    suffix_decoding_max_spec_factor (suffix): draft tokens per matched token (default 1.0).
    suffix_decoding_min_token_prob (suffix): a draft token must have followed at least this share of the matches
        (default 0.1).
    adaptive: fit each request's drafts to its acceptance and speculate only at batch sizes where it measurably
        pays (engine/speculative/controller.py); False: every decoding request gets what the proposer finds (in
        steps where no prompt waits for the budget).
    Keys of the other methods are refused; the method's own keys left out take their defaults.
    """

    method: Literal["ngram", "suffix", "draft_model"] | None = None
    model: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    suffix_decoding_max_tree_depth: int | None = None
    suffix_decoding_max_cached_requests: int | None = None
    suffix_decoding_max_spec_factor: float | None = None
    suffix_decoding_min_token_prob: float | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method is None:
            object.__setattr__(self, "method", "draft_model" if self.model is not None else "ngram")
        if self.method not in ("ngram", "suffix", "draft_model"):
            raise ValueError(f"speculative_config.method must be ngram, suffix or draft_model, got {self.method!r}")
        if (self.model is not None) != (self.method == "draft_model"):
            raise ValueError(
                "speculative_config.model is the draft of method draft_model"
                if self.model is not None
                else "speculative_config method draft_model needs model: the draft's checkpoint directory"
            )
        if self.model is not None and self.model != DEFAULT_DRAFT and not Path(self.model).is_dir():
            raise ValueError(f"speculative_config.model: {self.model!r} is not a checkpoint directory")
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}"
            )
        own = {"ngram": NGRAM_DEFAULTS, "suffix": SUFFIX_DEFAULTS, "draft_model": {}}[self.method]
        for key in sorted({**NGRAM_DEFAULTS, **SUFFIX_DEFAULTS}.keys() - own.keys()):
            if getattr(self, key) is not None:
                raise ValueError(f"speculative_config.{key} is not a setting of method {self.method!r}")
        for key, default in own.items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, default)
        if self.method == "draft_model":
            return
        if self.method == "ngram":
            if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
                raise ValueError(
                    "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                    f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
                )
            return
        checks = {
            "suffix_decoding_max_tree_depth": self.suffix_decoding_max_tree_depth >= 1,
            "suffix_decoding_max_cached_requests": self.suffix_decoding_max_cached_requests >= 0,
            "suffix_decoding_max_spec_factor": self.suffix_decoding_max_spec_factor > 0,
            "suffix_decoding_min_token_prob": 0 <= self.suffix_decoding_min_token_prob <= 1,
        }
        for key, valid in checks.items():
            if not valid:
                raise ValueError(f"speculative_config.{key} is out of range: {getattr(self, key)!r}")
