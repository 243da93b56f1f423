"""Grammar engines for structured outputs, xgrammar against llguidance, on a CPU.

It trains a byte-level BPE tokenizer offline (the project's `train_tokenizer`, on Python stdlib sources and
/usr/share/doc text; cached under --cache-dir), wraps it in `PreTrainedTokenizerFast` with `<|eos|>`, pads
the model vocabulary past the tokenizer's (logits 64 wider than the vocab, like Phi-3's 32064), and measures
per engine:

- tokenizer info: `xgrammar.TokenizerInfo.from_huggingface` / `llguidance.hf.from_tokenizer`;
- compile: json_object (`{"type": "object"}`), a nested JSON schema (required fields, enum, array of objects,
  integer bounds, a maxLength string, a pattern) cold, cached, in the other whitespace mode and, for a schema
  never seen, on a compiler that has compiled others; the regex `\\d{3}-\\d{4}`; a choice among 4 strings; a
  small EBNF grammar. Cold means the compiler's cache was cleared first: xgrammar keeps per-rule token masks
  across grammars, so its very first schema costs far more than later new ones. llguidance has no compile
  cache: its "compile" builds an `LLMatcher` from the grammar string (lexer built lazily), "cached" is the
  same again, and a repeat request is served by `deep_copy()` of a kept matcher;
- per decode step, 64 matchers at staggered offsets of a tokenized valid instance of the schema: filling a
  [64, vocab] int32 bitmask row by row (serial) and with the batch API (xgrammar `BatchGrammarMatcher`,
  llguidance `LLExecutor`; the two alternate over steps), applying it to fp32 logits [64, vocab] in place with
  each engine's own helper, and accepting one token per row (one call each, or the batch accept);
- first-pass fill: one fresh matcher right after a cold compile, filling a single row at every token of the
  instance, then a second pass;
- correctness: every token of the instance is allowed by its mask, EOS is allowed after the instance and
  terminates the matcher, an invalid token is masked off and rejected, padded vocabulary ids stay masked, and
  how JSON strings treat escapes, raw control characters and special tokens;
- the apply kernels on their own (both engines' bitmasks share one layout, so any kernel serves either);
- the GIL: the main thread spins while a second thread compiles or fills; a call that holds the GIL stalls
  the main thread for about the call's length (see the two controls).

    .venv/bin/python -m benchmarks.grammar_engines                         # 32k vocab, ~1.5 min
    .venv/bin/python -m benchmarks.grammar_engines --vocab 32000 128000    # ~3-6 min

Times are medians: of the repeats (compile) or steps (fill/apply/accept) within a round, then the median of the
rounds (--rounds). Batch fill threads default to all cores (both engines' defaults would use 1 on 2 cores).
"""

import argparse
import gzip
import hashlib
import importlib.metadata
import itertools
import json
import os
import statistics
import sysconfig
import threading
import time
from pathlib import Path

import llguidance as llg
import llguidance.hf
import llguidance.torch as llg_torch
import numpy as np
import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerFast

from kvserve.testing.tiny_checkpoint import EOS_TOKEN, IM_END, train_tokenizer

BATCH = 64
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 1000000},
        "name": {"type": "string", "maxLength": 40},
        "status": {"enum": ["active", "suspended", "deleted", "pending"]},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "orders": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "price": {"type": "number"},
                },
                "required": ["sku", "quantity", "price"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 10,
        },
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "verified": {"type": "boolean"},
    },
    "required": ["id", "name", "status", "address", "orders", "verified"],
    "additionalProperties": False,
}
INSTANCE = {
    "id": 48213,
    "name": "Margaret Hamilton-Okafor",
    "status": "suspended",
    "address": {"street": "1428 Elm Street, Apt. 3B", "city": "Springfield", "zip": "62704"},
    "orders": [
        {"sku": "KB-2291-BLK", "quantity": 2, "price": 49.99},
        {"sku": "MS-0042", "quantity": 1, "price": 19.5},
        {"sku": "USBC-HUB-7", "quantity": 12, "price": 34.0},
        {"sku": "CBL-3M", "quantity": 4, "price": 7.25},
    ],
    "tags": ["priority", "wholesale", "net-30"],
    "verified": False,
}
REGEX = r"\d{3}-\d{4}"
CHOICES = ["positive", "negative", "neutral", "mixed feelings"]
EBNF = """root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+
"""
WIDE_SCHEMA = {  # for the GIL probe: long enough a compile to see the main thread stall or not
    "type": "object",
    "properties": {f"field_{i}": SCHEMA for i in range(30)},
    "required": [f"field_{i}" for i in range(30)],
    "additionalProperties": False,
}
GIL_FILL_ROWS = 512
VARIANTS = itertools.count()
GRAMMARS = ("json_object", "schema", "schema_other_ws", "regex", "choice", "ebnf")


def build_corpus(target_bytes: int) -> str:
    """Up to 64 KB per file, alternating Python stdlib sources and /usr/share/doc text, in sorted order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)
    docs = sorted(p for p in Path("/usr/share/doc").rglob("*") if p.is_file())
    parts, size = [], 0
    for pair in zip(sources, docs, strict=False):
        for path in pair:
            try:
                if path.suffix == ".gz":
                    with gzip.open(path) as file:
                        data = file.read()
                else:
                    data = path.read_bytes()
            except (OSError, EOFError):
                continue
            if b"\0" in data[:4096]:
                continue
            text = data[:65536].decode("utf-8", errors="ignore")
            parts.append(text)
            size += len(text)
        if size >= target_bytes:
            break
    return "\n".join(parts)


def load_tokenizer(vocab: int, cache_dir: str) -> tuple[PreTrainedTokenizerFast, float]:
    """The trained tokenizer (from the cache when there) and the seconds training took (0 when cached)."""
    cached = Path(cache_dir) / f"bpe-{vocab}" if cache_dir else None
    if cached is not None and (cached / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(cached), 0.0
    corpus = build_corpus(max(8_000_000, vocab * 300))
    start_s = time.perf_counter()
    tokenizer = train_tokenizer(corpus, vocab)
    train_s = time.perf_counter() - start_s
    if cached is not None:
        tokenizer.save_pretrained(cached)
    return tokenizer, train_s


def choice_ebnf(options: list[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(option) for option in options)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, model_vocab: int, stop_ids: list[int], threads: int, compact: bool):
        self.tokenizer, self.model_vocab, self.stop_ids, self.threads = tokenizer, model_vocab, stop_ids, threads
        self.compact = compact

    def build_info(self) -> None:
        self.info = xgr.TokenizerInfo.from_huggingface(
            self.tokenizer, vocab_size=self.model_vocab, stop_token_ids=self.stop_ids
        )
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=self.threads)
        self.batch = xgr.BatchGrammarMatcher(max_threads=self.threads)

    def compile_schema(self, schema: dict, compact: bool | None = None):
        any_whitespace = not (self.compact if compact is None else compact)
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=any_whitespace, strict_mode=True)

    def compile(self, kind: str):
        if kind == "json_object":  # any object; the builtin JSON grammar would also allow an array
            schema = '{"type": "object"}'
            return self.compiler.compile_json_schema(schema, any_whitespace=not self.compact, strict_mode=False)
        if kind in ("schema", "schema_other_ws"):
            return self.compile_schema(SCHEMA, compact=self.compact == (kind == "schema"))
        if kind == "regex":
            return self.compiler.compile_regex(REGEX)
        if kind == "choice":
            return self.compiler.compile_grammar(choice_ebnf(CHOICES))
        return self.compiler.compile_grammar(EBNF)

    def clear_cache(self) -> None:
        self.compiler.clear_cache()

    def matcher(self, compiled):
        return xgr.GrammarMatcher(compiled)

    def repeat_request(self, kind: str):
        """A ready matcher for a request whose grammar was compiled before (a compiler cache hit)."""
        return xgr.GrammarMatcher(self.compile(kind))

    def allocate(self, rows: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(rows, self.model_vocab)

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, matchers, bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        xgr.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def accept_batch(self, matchers, tokens: list[int]) -> list[bool]:
        return xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)

    def terminated(self, matcher) -> bool:
        return matcher.is_terminated()

    def reset(self, matcher) -> None:
        matcher.reset()

    def gil_compile_work(self):
        compiler, schema = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False), json.dumps(WIDE_SCHEMA)
        return lambda: compiler.compile_json_schema(schema)

    def gil_fill_work(self, matchers, bitmask):
        batch = xgr.BatchGrammarMatcher(max_threads=1)
        return lambda: batch.batch_fill_next_token_bitmask(matchers, bitmask)


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer, model_vocab: int, stop_ids: list[int], threads: int, compact: bool):
        self.tokenizer, self.model_vocab, self.stop_ids, self.threads = tokenizer, model_vocab, stop_ids, threads
        self.compact, self.templates = compact, {}

    def build_info(self) -> None:
        self.info = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.model_vocab, eos_token=self.stop_ids)
        self.executor = llg.LLExecutor(num_threads=self.threads)

    @staticmethod
    def schema_grammar(schema: dict, compact: bool) -> str:
        if not compact:
            return llg.LLMatcher.grammar_from_json_schema(schema)
        options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        return llg.LLMatcher.grammar_from_json_schema(schema, overrides=options)

    def compile_schema(self, schema: dict, compact: bool | None = None):
        return self.build(self.schema_grammar(schema, self.compact if compact is None else compact))

    def build(self, grammar: str):
        matcher = llg.LLMatcher(self.info, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def grammar(self, kind: str) -> str:
        if kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"})
        if kind in ("schema", "schema_other_ws"):
            return self.schema_grammar(SCHEMA, compact=self.compact == (kind == "schema"))
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(REGEX)
        if kind == "choice":
            return llg.grammar_from("choice", json.dumps(CHOICES))
        return llg.grammar_from("ebnf", EBNF)

    def compile(self, kind: str):
        self.templates[kind] = self.build(self.grammar(kind))
        return self.templates[kind]

    def clear_cache(self) -> None:
        pass  # llguidance keeps no compile cache

    def matcher(self, compiled):
        return compiled.deep_copy()

    def repeat_request(self, kind: str):
        """A ready matcher for a request whose grammar was built before: a copy of the kept template."""
        return self.templates[kind].deep_copy()

    def allocate(self, rows: int) -> torch.Tensor:
        return llg_torch.allocate_token_bitmask(rows, self.model_vocab)

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        llg_torch.fill_next_token_bitmask(matcher, bitmask, row)

    def fill_batch(self, matchers, bitmask: torch.Tensor) -> None:
        pairs = [(matcher, row) for row, matcher in enumerate(matchers)]
        llg_torch.fill_next_token_bitmask_par(self.executor, pairs, bitmask)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        llg_torch.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def accept_batch(self, matchers, tokens: list[int]) -> list[bool]:
        return self.executor.consume_token_par(list(zip(matchers, tokens, strict=True)))

    def terminated(self, matcher) -> bool:
        return matcher.is_stopped() and not matcher.is_error()

    def reset(self, matcher) -> None:
        matcher.reset()

    def gil_compile_work(self):
        grammar = llg.LLMatcher.grammar_from_json_schema(WIDE_SCHEMA)
        return lambda: llg.LLMatcher(self.info, grammar, log_level=0)

    def gil_fill_work(self, matchers, bitmask):
        executor = llg.LLExecutor(num_threads=1)
        pairs = [(matcher, row) for row, matcher in enumerate(matchers)]
        return lambda: llg_torch.fill_next_token_bitmask_par(executor, pairs, bitmask)


def allowed(mask_row: np.ndarray, token: int) -> bool:
    return bool((int(mask_row[token >> 5]) >> (token & 31)) & 1)


def popcount(mask_row: np.ndarray, vocab: int) -> int:
    bits = np.unpackbits(mask_row.view(np.uint8), bitorder="little")[:vocab]
    return int(bits.sum())


def timed(fn, *args) -> tuple[float, object]:
    start_s = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - start_s, result


def measure_compiles(engine, repeats: int) -> dict:
    """Median ms of cold and cached compiles per grammar kind, the repeat-request matcher and time to first mask."""
    out = {}
    bitmask = engine.allocate(1)
    for kind in GRAMMARS:
        cold, cached, first_mask = [], [], []
        for _ in range(repeats):
            engine.clear_cache()
            seconds, compiled = timed(engine.compile, kind)
            cold.append(seconds * 1e3)
            start_s = time.perf_counter()
            engine.fill(engine.matcher(compiled), bitmask, 0)
            first_mask.append((time.perf_counter() - start_s) * 1e3 + cold[-1])
            cached.append(timed(engine.compile, kind)[0] * 1e3)
        repeat_us = [timed(engine.repeat_request, kind)[0] * 1e6 for _ in range(repeats)]
        if kind == "schema":  # schemas not compiled before, on a compiler that has compiled others
            out["new_schema_warm_ms"] = statistics.median(
                timed(engine.compile_schema, schema_variant())[0] * 1e3 for _ in range(repeats)
            )
        out[kind] = {
            "cold_ms": statistics.median(cold),
            "cached_ms": statistics.median(cached),
            "first_mask_ms": statistics.median(first_mask),
            "repeat_request_us": statistics.median(repeat_us),
        }
    return out


def schema_variant() -> dict:
    """SCHEMA with one more optional field and its own id maximum: a schema no cache has seen."""
    number = next(VARIANTS)
    variant = json.loads(json.dumps(SCHEMA))
    variant["properties"][f"note_{number}"] = {"type": "string"}
    variant["properties"]["id"]["maximum"] = 2_000_000 + number
    return variant


def first_pass(engine, tokens: list[int]) -> dict:
    """µs per fill on a fresh matcher's first walk over the instance (right after a cold compile), then again."""
    engine.clear_cache()
    compiled = engine.compile("schema")
    matcher = engine.matcher(compiled)
    bitmask = engine.allocate(1)
    passes = []
    for _ in range(2):
        spent = 0.0
        for token in tokens:
            spent += timed(engine.fill, matcher, bitmask, 0)[0]
            assert engine.accept(matcher, token)
        passes.append(spent / len(tokens) * 1e6)
        engine.reset(matcher)
    return {"first_pass_us": passes[0], "second_pass_us": passes[1]}


def check_correctness(engine, tokenizer, tokens: list[int], tokenizer_vocab: int) -> list[str]:
    """Failures (empty when all checks pass)."""
    failures = []
    eos = tokenizer.eos_token_id
    bitmask = engine.allocate(1)
    row = bitmask.numpy()[0]
    matcher = engine.matcher(engine.compile("schema"))
    for position, token in enumerate(tokens):
        engine.fill(matcher, bitmask, 0)
        if not allowed(row, token):
            failures.append(f"schema: token {position} ({tokenizer.decode([token])!r}) masked off")
        if not engine.accept(matcher, token):
            failures.append(f"schema: token {position} rejected")
            break
    engine.fill(matcher, bitmask, 0)
    if not allowed(row, eos):
        failures.append("schema: EOS masked off after a complete instance")
    if popcount(row, engine.model_vocab) > len(engine.stop_ids) + 8:
        failures.append(f"schema: {popcount(row, engine.model_vocab)} tokens allowed after a complete instance")
    if not engine.accept(matcher, eos) or not engine.terminated(matcher):
        failures.append("schema: EOS not accepted or matcher not terminated")
    bad = tokenizer.convert_tokens_to_ids("x")
    matcher = engine.matcher(engine.compile("schema"))
    engine.fill(matcher, bitmask, 0)
    if allowed(row, bad) or engine.accept(matcher, bad):
        failures.append("schema: 'x' allowed at the start of an object")
    if any(allowed(row, token) for token in range(tokenizer_vocab, engine.model_vocab)):
        failures.append("schema: a padded vocabulary id is allowed")
    for kind, good, wrong in (("regex", "555-1234", "55a"), ("choice", "mixed feelings", "mixed f!")):
        matcher = engine.matcher(engine.compile(kind))
        if not all(engine.accept(matcher, t) for t in tokenizer.encode(good, add_special_tokens=False)):
            failures.append(f"{kind}: {good!r} rejected")
        elif not (engine.accept(matcher, eos) and engine.terminated(matcher)):
            failures.append(f"{kind}: EOS not accepted after {good!r}")
        matcher = engine.matcher(engine.compile(kind))
        if all(engine.accept(matcher, t) for t in tokenizer.encode(wrong, add_special_tokens=False)):
            failures.append(f"{kind}: {wrong!r} accepted")
    return failures


def string_checks(engine, tokenizer) -> str:
    """How a JSON string field (plain, and with maxLength) treats an escape, a raw control character (invalid
    JSON) and the special tokens <|bos|>/<|im_start|> in its mask."""
    eos, specials = engine.stop_ids[0], [tokenizer.bos_token_id, tokenizer.convert_tokens_to_ids("<|im_start|>")]
    bitmask = engine.allocate(1)
    parts = []
    for label, field in (("string", {"type": "string"}), ("maxLength string", {"type": "string", "maxLength": 40})):
        schema = {"type": "object", "properties": {"a": field}, "required": ["a"], "additionalProperties": False}
        compiled = engine.compile_schema(schema)

        def accepts(text: str, compiled=compiled) -> bool:
            matcher = engine.matcher(compiled)
            ids = [*tokenizer.encode(text, add_special_tokens=False), eos]
            return all(engine.accept(matcher, token) for token in ids)

        matcher = engine.matcher(compiled)
        for token in tokenizer.encode('{"a": "x', add_special_tokens=False):
            engine.accept(matcher, token)
        engine.fill(matcher, bitmask, 0)
        special_allowed = sum(allowed(bitmask.numpy()[0], token) for token in specials)
        escape_ok = accepts(json.dumps({"a": 'x"y'}))  # {"a": "x\"y"}
        control_ok = accepts('{"a": "x\x01y"}')  # an unescaped control character: not JSON
        parts.append(
            f"{label}: escape {'ok' if escape_ok else 'REJECTED'}, raw control char "
            f"{'ACCEPTED' if control_ok else 'rejected'}, special tokens allowed inside: {special_allowed}/2"
        )
    return f"{engine.name} JSON strings: " + "; ".join(parts)


def compare_masks(xgr_rows: np.ndarray, llg_rows: np.ndarray, vocab: int) -> list[str]:
    same = sum(np.array_equal(a, b) for a, b in zip(xgr_rows, llg_rows, strict=True))
    counts = [(popcount(a, vocab), popcount(b, vocab)) for a, b in zip(xgr_rows, llg_rows, strict=True)]
    differing = [f"{i}: {a}/{b}" for i, (a, b) in enumerate(counts) if a != b]
    return [
        f"masks at the 64 staggered positions: {same}/64 rows identical between engines; allowed tokens "
        "xgrammar/llguidance by row where they differ: " + (", ".join(differing) or "none")
    ]


def apply_kernels(model_vocab: int, repeats: int) -> list[str]:
    """Median (min) ms of the apply kernels on one random [64, vocab] bitmask: both engines' bitmasks are the
    same int32 layout (bit j of word j // 32 of a row = token j allowed), so any kernel serves either engine."""
    bitmask = xgr.allocate_token_bitmask(BATCH, model_vocab).random_(-(2**31), 2**31 - 1)
    base = torch.randn(BATCH, model_vocab)
    logits = base.clone()
    kernels = {
        "xgrammar cpu (C++), 64 rows": lambda: xgr.apply_token_bitmask_inplace(logits, bitmask),
        "xgrammar cpu, indices=16 of 64 rows": lambda: xgr.apply_token_bitmask_inplace(
            logits, bitmask, indices=list(range(0, BATCH, 4))
        ),
        "llguidance.torch (torch.compile), 64 rows": lambda: llg_torch.apply_token_bitmask_inplace(logits, bitmask),
        "xgrammar backend=torch_compile, 64 rows": lambda: xgr.apply_token_bitmask_inplace(
            logits, bitmask, backend="torch_compile"
        ),
    }
    lines, results = [f"apply kernels, {torch.get_num_threads()} torch threads, ms median (min):"], []
    for label, kernel in kernels.items():
        kernel()
        times = []
        for _ in range(repeats):
            logits.copy_(base)
            times.append(timed(kernel)[0] * 1e3)
        results.append(logits.clone())
        lines.append(f"  {label:45} {statistics.median(times):7.3f} ({min(times):.3f})")
    full = [result for label, result in zip(kernels, results, strict=True) if "indices" not in label]
    lines.append(f"  same logits from the 64-row kernels: {all(torch.equal(full[0], other) for other in full)}")
    return lines


def gil_line(label: str, work, calls: int) -> str:
    call_ms, rate, longest_ms = gil_probe(work, calls)
    return (
        f"  {label:55} {call_ms:8.1f} ms a call; main loop {rate:7.0f} iterations/ms, "
        f"longest stall {longest_ms:6.1f} ms"
    )


def gil_controls(calls: int) -> list[str]:
    """Calibration: CPU-bound calls that release the GIL (sha256 of 16 MB) and hold it (builtin sum)."""
    data = bytes(16 << 20)
    return [
        "GIL probe: a thread loops over the call while the main thread spins; a call holding the GIL cuts the main "
        "loop's rate and stalls it for about the call's length",
        gil_line("control, hashlib.sha256 of 16 MB: releases", lambda: hashlib.sha256(data).digest(), calls),
        gil_line("control, sum(range(1_000_000)): holds", lambda: sum(range(1_000_000)), calls),
    ]


def gil_checks(engine, tokens: list[int], calls: int) -> list[str]:
    compiled = engine.compile("schema")
    matchers = [engine.matcher(compiled) for _ in range(GIL_FILL_ROWS)]
    for row, matcher in enumerate(matchers):
        for token in tokens[: row * len(tokens) // GIL_FILL_ROWS]:
            engine.accept(matcher, token)
    probes = {
        "compile of a 30-field-wide schema": engine.gil_compile_work(),
        f"{GIL_FILL_ROWS}-row batch fill, 1 thread": engine.gil_fill_work(matchers, engine.allocate(GIL_FILL_ROWS)),
    }
    return [gil_line(f"{engine.name}, {label}", work, calls) for label, work in probes.items()]


def measure_steps(engine, tokens: list[int], steps: int, warmup: int) -> tuple[dict, np.ndarray, int]:
    """Per-step fill/apply/accept over 64 matchers at staggered offsets; also the first step's bitmask."""
    compiled = engine.compile("schema")
    matchers = [engine.matcher(compiled) for _ in range(BATCH)]
    positions = [row * len(tokens) // BATCH for row in range(BATCH)]
    for matcher, position in zip(matchers, positions, strict=True):
        for token in tokens[:position]:
            assert engine.accept(matcher, token)
    bitmask = engine.allocate(BATCH)
    rows = bitmask.numpy()
    base_logits = torch.randn(BATCH, engine.model_vocab, generator=torch.Generator().manual_seed(0))
    logits = torch.empty_like(base_logits)
    eos = engine.stop_ids[0]
    samples = {"serial": [], "parallel": [], "apply": [], "accept": [], "accept_batch": []}
    first_bitmask, violations = None, 0
    for step in range(warmup + steps):
        record = step >= warmup
        parallel = step % 2 == 1
        if parallel:
            seconds = timed(engine.fill_batch, matchers, bitmask)[0]
        else:
            seconds = timed(lambda: [engine.fill(m, bitmask, i) for i, m in enumerate(matchers)])[0]
        if record:
            samples["parallel" if parallel else "serial"].append(seconds * 1e3)
        if first_bitmask is None:
            first_bitmask = rows.copy()
        next_tokens = [tokens[p] if p < len(tokens) else eos for p in positions]
        violations += sum(not allowed(rows[i], t) for i, t in enumerate(next_tokens))
        logits.copy_(base_logits)
        seconds = timed(engine.apply, logits, bitmask)[0]
        if record:
            samples["apply"].append(seconds * 1e3)
        if parallel:
            seconds, results = timed(engine.accept_batch, matchers, next_tokens)
            if record:
                samples["accept_batch"].append(seconds / BATCH * 1e6)
            violations += sum(not ok for ok in results)
        else:
            for matcher, token in zip(matchers, next_tokens, strict=True):
                seconds, ok = timed(engine.accept, matcher, token)
                violations += not ok
                if record:
                    samples["accept"].append(seconds * 1e6)
        for row, matcher in enumerate(matchers):
            positions[row] += 1
            if positions[row] > len(tokens):
                violations += not engine.terminated(matcher)
                engine.reset(matcher)
                positions[row] = 0
    return {key: statistics.median(values) for key, values in samples.items()}, first_bitmask, violations


def gil_probe(work, calls: int) -> tuple[float, float, float]:
    """Run `work` `calls` times in a thread while the main thread spins: the median call ms, the main thread's
    loop iterations per ms meanwhile, and its longest stall in ms. A call that holds the GIL stops the main
    thread for all of it; one that releases it lets it run (on a loaded machine, minus preemption)."""
    in_call, done = [], threading.Event()

    def worker():
        for _ in range(calls):
            in_call.append(timed(work)[0])
        done.set()

    longest_s, iterations, thread = 0.0, 0, threading.Thread(target=worker)
    start_s = previous_s = time.perf_counter()
    thread.start()
    while not done.is_set():
        now_s = time.perf_counter()
        longest_s, previous_s, iterations = max(longest_s, now_s - previous_s), now_s, iterations + 1
    thread.join()
    rate = iterations / ((time.perf_counter() - start_s) * 1e3)
    return statistics.median(in_call) * 1e3, rate, longest_s * 1e3


def run_round(engine, tokenizer, tokens, tokenizer_vocab, args) -> dict:
    info_s = timed(engine.build_info)[0]
    result = {"info_s": info_s}
    result["compile"] = measure_compiles(engine, args.compile_repeats)
    result.update(first_pass(engine, tokens))
    steps, first_bitmask, violations = measure_steps(engine, tokens, args.steps, args.warmup_steps)
    result.update(steps)
    result["first_bitmask"], result["violations"] = first_bitmask, violations
    return result


def median_of(rounds: list[dict], *keys) -> float:
    values = []
    for result in rounds:
        for key in keys:
            result = result[key]
        values.append(result)
    return statistics.median(values)


def report(vocab: int, tokenizer_vocab: int, model_vocab: int, train_s: float, results: dict, extras: dict) -> None:
    print(f"\n### vocab {vocab}: tokenizer {tokenizer_vocab} tokens, logits/bitmask width {model_vocab}", end="")
    print(f" (trained in {train_s:.1f} s)" if train_s else " (tokenizer from cache)")
    print(
        f"instance: {extras['instance_tokens']} tokens; schema whitespace: {extras['whitespace']}; threads for batch "
        f"fill: {extras['threads']}; cold = compiler cache cleared first, cached = the same grammar again\n"
    )
    print(
        "| engine | tokenizer info s | compile json_object ms | compile schema ms (cold/cached) | regex ms "
        "| choice ms | fill 64 rows ms (serial / parallel) | apply mask ms | accept µs |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, rounds in results.items():
        med = lambda *keys, rounds=rounds: median_of(rounds, *keys)  # noqa: E731
        print(
            f"| {name} | {med('info_s'):.3f} | {med('compile', 'json_object', 'cold_ms'):.2f} "
            f"| {med('compile', 'schema', 'cold_ms'):.2f} / {med('compile', 'schema', 'cached_ms'):.3f} "
            f"| {med('compile', 'regex', 'cold_ms'):.2f} | {med('compile', 'choice', 'cold_ms'):.2f} "
            f"| {med('serial'):.2f} / {med('parallel'):.2f} | {med('apply'):.2f} | {med('accept'):.1f} |"
        )
    print(
        "\n| engine | new schema, warm compiler ms | schema, other whitespace, cold ms | ebnf ms "
        "| schema cold compile + first mask ms | repeat-request matcher µs | first-pass fill µs/tok (later pass) "
        "| batch accept µs/row | json_object cached ms | step violations |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, rounds in results.items():
        med = lambda *keys, rounds=rounds: median_of(rounds, *keys)  # noqa: E731
        print(
            f"| {name} | {med('compile', 'new_schema_warm_ms'):.2f} "
            f"| {med('compile', 'schema_other_ws', 'cold_ms'):.2f} "
            f"| {med('compile', 'ebnf', 'cold_ms'):.2f} | {med('compile', 'schema', 'first_mask_ms'):.2f} "
            f"| {med('compile', 'schema', 'repeat_request_us'):.1f} "
            f"| {med('first_pass_us'):.1f} ({med('second_pass_us'):.1f}) | {med('accept_batch'):.2f} "
            f"| {med('compile', 'json_object', 'cached_ms'):.3f} | {sum(r['violations'] for r in rounds)} |"
        )
    print("\nper round, fill 64 rows ms serial/parallel, schema cold compile ms:")
    for name, rounds in results.items():
        cells = [f"{r['serial']:.2f}/{r['parallel']:.2f}, {r['compile']['schema']['cold_ms']:.1f}" for r in rounds]
        print(f"  {name:10} " + "   ".join(cells))
    for line in extras["notes"]:
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000], help="BPE vocab sizes to train")
    parser.add_argument("--pad-vocab", type=int, default=64, help="model vocab = tokenizer vocab + this")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps per round")
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--compile-repeats", type=int, default=5)
    parser.add_argument(
        "--whitespace",
        choices=("compact", "flexible"),
        default="compact",
        help="schema whitespace in the step loop: fixed ', ' and ': ' (xgrammar any_whitespace=False) or free",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for batch fill and compile")
    parser.add_argument("--gil-calls", type=int, default=10, help="calls per GIL probe; 0 skips them")
    parser.add_argument("--cache-dir", default="/tmp/kvserve-grammar-bench", help="'' to retrain every run")
    args = parser.parse_args()
    versions = f"xgrammar {importlib.metadata.version('xgrammar')}, {llg.get_version()}, torch {torch.__version__}"
    print(f"{versions}; {torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs")

    for vocab in args.vocab:
        tokenizer, train_s = load_tokenizer(vocab, args.cache_dir)
        tokenizer_vocab = len(tokenizer)
        model_vocab = tokenizer_vocab + args.pad_vocab
        stop_ids = [tokenizer.convert_tokens_to_ids(EOS_TOKEN), tokenizer.convert_tokens_to_ids(IM_END)]
        document = json.dumps(INSTANCE)
        tokens = tokenizer.encode(document, add_special_tokens=False)
        assert tokenizer.decode(tokens) == document
        compact = args.whitespace == "compact"
        engines = [cls(tokenizer, model_vocab, stop_ids, args.threads, compact) for cls in (Xgrammar, Llguidance)]
        notes = []

        for engine in engines:  # one-time costs: llguidance's apply is a torch.compile kernel
            engine.build_info()
            logits, bitmask = torch.zeros(BATCH, model_vocab), engine.allocate(BATCH)
            first_apply_s = timed(engine.apply, logits, bitmask)[0]
            notes.append(f"{engine.name}: first apply_token_bitmask_inplace {first_apply_s:.2f} s")
            failures = check_correctness(engine, tokenizer, tokens, tokenizer_vocab)
            notes.append(f"{engine.name}: correctness " + ("ok" if not failures else "FAILED: " + "; ".join(failures)))
            notes.append(string_checks(engine, tokenizer))

        results = {engine.name: [] for engine in engines}
        for round_index in range(args.rounds):
            order = engines if round_index % 2 == 0 else engines[::-1]
            for engine in order:
                results[engine.name].append(run_round(engine, tokenizer, tokens, tokenizer_vocab, args))
            print(f"vocab {vocab}: round {round_index + 1}/{args.rounds} done", flush=True)

        notes += compare_masks(*(results[engine.name][0]["first_bitmask"] for engine in engines), model_vocab)
        notes += apply_kernels(model_vocab, args.steps)
        if args.gil_calls > 0:
            notes += gil_controls(args.gil_calls)
            for engine in engines:
                notes += gil_checks(engine, tokens, args.gil_calls)
        extras = {
            "instance_tokens": len(tokens),
            "threads": args.threads,
            "whitespace": args.whitespace,
            "notes": notes,
        }
        report(vocab, tokenizer_vocab, model_vocab, train_s, results, extras)


if __name__ == "__main__":
    main()
