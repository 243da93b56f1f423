"""Structured outputs with xgrammar: grammars compiled off the step thread and cached, one matcher per
request, and the token mask of every constrained row of a step applied to the logits at once.

Compiling can take from milliseconds (a regex) to a second (a large JSON schema), so the server compiles
on a worker thread before it queues the request (`GrammarCompiler.compile` is thread-safe and cached);
queuing then finds the grammar compiled. A request's matcher follows its output tokens, so preemption
(which keeps the tokens and recomputes their KV) leaves it as it is.

xgrammar (which needs pydantic) is imported on first use, so the engine still runs where only torch,
triton and transformers are installed, as long as no request asks for structured output.
"""

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from engine.errors import InvalidRequestError
from engine.sampling_params import GrammarSpec

if TYPE_CHECKING:
    import xgrammar

MAX_CACHED_GRAMMARS = 512
# xgrammar's errors start with a time and its C++ source line: clients get the reason only.
_SOURCE_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarCompiler:
    """Compiles `GrammarSpec`s for one tokenizer; a spec compiled before is returned from the cache."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None  # built on first use: it scans the vocabulary
        self._cache: OrderedDict[GrammarSpec, xgrammar.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> "xgrammar.CompiledGrammar":
        """Raises `InvalidRequestError` (field `structured_output`) for a schema, regex or grammar that does not
        compile."""
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                return compiled
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids
                )
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=2)
        # Outside the lock: a long compile does not hold up requests whose grammars are cached.
        try:
            compiled = _compile(self._compiler, spec)
        except (RuntimeError, ValueError, TypeError) as error:
            reason = _SOURCE_LOCATION.sub("", str(error)).strip()
            raise InvalidRequestError("structured_output", f"the {spec.kind} does not compile: {reason}") from None
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: GrammarSpec) -> "xgrammar.GrammarMatcher":
        import xgrammar

        return xgrammar.GrammarMatcher(self.compile(spec))


def _compile(compiler: "xgrammar.GrammarCompiler", spec: GrammarSpec) -> "xgrammar.CompiledGrammar":
    match spec.kind:
        case "json_object":
            # Any object (OpenAI's json_object), not xgrammar's builtin JSON grammar, which allows any value.
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        case "json_schema":
            # Whitespace between tokens is fixed (", " and ": "): a free one lets a model pad forever.
            return compiler.compile_json_schema(spec.source, any_whitespace=False, strict_mode=spec.strict)
        case "regex":
            return compiler.compile_regex(spec.source)
        case "choice":
            alternatives = " | ".join(json.dumps(choice) for choice in json.loads(spec.source))
            return compiler.compile_grammar(f"root ::= {alternatives}")
        case "grammar":
            return compiler.compile_grammar(spec.source)
    raise ValueError(f"unknown grammar kind {spec.kind!r}")


class TokenMasks:
    """Applies the grammars of a step's constrained rows to its logits in one call."""

    def __init__(self, max_num_rows: int, vocab_size: int) -> None:
        self.max_num_rows = max_num_rows
        self.vocab_size = vocab_size
        self._bitmask: torch.Tensor | None = None  # made on first use, with xgrammar
        self._batch = None

    def apply(self, logits: torch.Tensor, rows: list[int], matchers: "list[xgrammar.GrammarMatcher]") -> None:
        """Set to -inf, in place, every token of row `rows[i]` that `matchers[i]` does not allow next."""
        import xgrammar

        if self._bitmask is None:
            self._bitmask = xgrammar.allocate_token_bitmask(self.max_num_rows, self.vocab_size)
            self._batch = xgrammar.BatchGrammarMatcher(max_threads=2)
        self._batch.batch_fill_next_token_bitmask(matchers, self._bitmask, indices=rows)
        bitmask = self._bitmask[: logits.shape[0]].to(logits.device, non_blocking=True)
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)
