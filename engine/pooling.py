"""Embeddings: what a model's embedding is (how its hidden states are pooled, whether the vector is normalised), read
from a sentence-transformers directory or the engine's settings, and the pooler that computes it as a request's
prompt is prefilled, chunk by chunk.

A sentence-transformers directory holds the transformer at its root and `modules.json` listing its modules: the
Transformer, a Pooling module (`1_Pooling/config.json`: `pooling_mode_lasttoken`, `_mean_tokens` or `_cls_token`)
and maybe Normalize. Other modules (Dense projections, ...) change the vector in ways kvserve does not compute: such
a model is refused by name. The hidden states pooled are the final norm's output, what the Transformer module's
`last_hidden_state` is.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from kvserve.engine.models.registry import is_headless
from kvserve.engine.request import ChatPrompt
from kvserve.engine.sampling_params import SamplingParams
from kvserve.scheduler import Request, SchedulerOutput

PoolingMethod = Literal["last", "mean", "cls"]
# An embedding request runs its prompt and "samples" once: where it finishes with its vector instead.
EMBEDDING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)
# A Pooling module's mode, as sentence-transformers 6 writes it ("pooling_mode") and as earlier versions did (one
# "pooling_mode_*" flag set).
_ST_POOLING_MODES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}
_ST_POOLING_FLAGS = {
    "pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
}  # fmt: skip
_ST_MODULES = ("Transformer", "Pooling", "Normalize")  # by class name: versions keep them in different packages


class PoolingConfigError(ValueError):
    """A model whose embedding kvserve cannot compute as its configuration says."""


@dataclass(frozen=True)
class PoolingConfig:
    method: PoolingMethod
    normalize: bool
    # The sizes a Matryoshka-trained model's vector may be cut to (`dimensions`); None: it may not be cut.
    matryoshka_dimensions: tuple[int, ...] | None = None
    # sentence-transformers 6 renders a text as one user message of the chat template (its "message" modality);
    # earlier versions, and `--task embed`, tokenize the text as it is.
    text_as_message: bool = False

    def prompt(self, text: str) -> "str | ChatPrompt":
        """An input text as the model's sentence-transformers configuration makes it a prompt."""
        return ChatPrompt([{"role": "user", "content": text}], None, False) if self.text_as_message else text


def read_pooling_config(
    model_dir: Path, task: str, method: PoolingMethod | None, normalize: bool | None
) -> PoolingConfig | None:
    """The model's embedding, or None for a generating engine. `task` "auto" embeds exactly when `model_dir` is a
    sentence-transformers directory; `method` and `normalize` (None: from that directory, else last-token pooling,
    normalised: Qwen3-Embedding's) override it."""
    modules_file = model_dir / "modules.json"
    hf_config = json.loads((model_dir / "config.json").read_text()) if (model_dir / "config.json").exists() else {}
    headless = is_headless(hf_config.get("architectures"))
    if task == "generate" or (task == "auto" and not modules_file.exists() and not headless):
        if headless:
            raise PoolingConfigError(f"{model_dir} holds a model without its LM head: it serves --task embed only")
        return None
    found_method, found_normalize = None, None
    text_as_message = False
    if modules_file.exists():
        found_method, found_normalize = _read_sentence_transformers(model_dir, modules_file)
        st_config_file = model_dir / "sentence_bert_config.json"
        st_config = json.loads(st_config_file.read_text()) if st_config_file.exists() else {}
        if st_config.get("do_lower_case"):
            raise PoolingConfigError(f"{model_dir}: lower-casing the input (do_lower_case) is not supported")
        text_as_message = "message" in st_config.get("modality_config", {})
    dimensions = hf_config.get("matryoshka_dimensions")  # vLLM's key, in the model's config.json
    if dimensions is None and hf_config.get("is_matryoshka"):
        dimensions = ()  # any size
    return PoolingConfig(
        method=method or found_method or "last",
        normalize=normalize if normalize is not None else (found_normalize if found_normalize is not None else True),
        matryoshka_dimensions=tuple(dimensions) if dimensions is not None else None,
        text_as_message=text_as_message,
    )


def _read_sentence_transformers(model_dir: Path, modules_file: Path) -> tuple[PoolingMethod, bool]:
    modules = json.loads(modules_file.read_text())
    method, normalize = None, False
    for module in modules:
        kind = str(module.get("type")).rsplit(".", 1)[-1]
        if kind not in _ST_MODULES:
            raise PoolingConfigError(f"{model_dir}: the sentence-transformers module {module.get('type')!r} is not "
                                     "supported")  # fmt: skip
        if kind == "Transformer" and module.get("path", "") != "":
            raise PoolingConfigError(f"{model_dir}: the transformer must be at the directory's root")
        if kind == "Pooling":
            method = _pooling_method(model_dir, json.loads((model_dir / module["path"] / "config.json").read_text()))
        normalize = normalize or kind == "Normalize"
    if method is None:
        raise PoolingConfigError(f"{model_dir}: modules.json has no Pooling module")
    return method, normalize


def _pooling_method(model_dir: Path, pooling: dict) -> PoolingMethod:
    if pooling.get("include_prompt") is False:
        raise PoolingConfigError(f"{model_dir}: pooling that leaves out the prompt (include_prompt false) is not "
                                 "supported")  # fmt: skip
    mode = pooling.get("pooling_mode")
    if isinstance(mode, str):
        chosen = [mode]
    else:
        chosen = [flag for flag, on in pooling.items() if flag.startswith("pooling_mode_") and on]
    methods = [_ST_POOLING_MODES.get(name) or _ST_POOLING_FLAGS.get(name) for name in chosen]
    if len(methods) != 1 or methods[0] is None:
        raise PoolingConfigError(f"{model_dir}: pooling {chosen} is not supported (one of lasttoken, mean, cls)")
    return methods[0]


class Pooler:
    """Each embedding request's pooled hidden state, gathered as its prompt's chunks are computed.

    A step's hidden rows come as the model runner returns them: first the row of each request whose chunk reaches
    its prompt's end (its last token), then the rows `rows` asked for. A preempted request computes its prompt again
    from the start, and its partial state starts again with it.
    """

    def __init__(self, config: PoolingConfig) -> None:
        self.config = config
        self._partial: dict[str, torch.Tensor] = {}  # mean: the sum so far; cls: the first token's state

    def rows(self, output: SchedulerOutput) -> list[int]:
        """The step's token rows to return besides the last tokens: every other row of each chunk for mean
        pooling, the first token's for cls."""
        if self.config.method == "last":
            return []
        rows, first_row = [], 0
        for item in output.scheduled:
            rows.extend(range(first_row, first_row + self._num_extra_rows(item)))  # a chunk's leading rows
            first_row += item.num_new_tokens
        return rows

    def collect(self, output: SchedulerOutput, hidden: torch.Tensor) -> list[tuple[Request, torch.Tensor]]:
        """Fold the step's rows into each request's state; the finished requests with their embeddings."""
        num_last = sum(item.samples_next_token for item in output.scheduled)
        last_rows, extra_rows = hidden[:num_last].float(), hidden[num_last:].float()
        finished, last_index, extra_index = [], 0, 0
        for item in output.scheduled:
            request_id = item.request.request_id
            num_extra = self._num_extra_rows(item)
            chunk = extra_rows[extra_index : extra_index + num_extra]
            extra_index += num_extra
            if item.start_position == 0:
                self._partial.pop(request_id, None)
            if self.config.method == "mean" and num_extra:
                self._partial[request_id] = self._partial.get(request_id, 0) + chunk.sum(dim=0)
            elif self.config.method == "cls" and num_extra:
                self._partial[request_id] = chunk[0]
            if not item.samples_next_token:
                continue
            last = last_rows[last_index]
            last_index += 1
            finished.append((item.request, self._embedding(item.request, last)))
        return finished

    def discard(self, request_id: str) -> None:
        self._partial.pop(request_id, None)

    def _num_extra_rows(self, item) -> int:
        num_rows = item.num_new_tokens - (1 if item.samples_next_token else 0)
        if self.config.method == "mean":
            return num_rows
        if self.config.method == "cls":
            return 1 if item.start_position == 0 and num_rows > 0 else 0
        return 0

    def _embedding(self, request: Request, last: torch.Tensor) -> torch.Tensor:
        partial = self._partial.pop(request.request_id, None)
        if self.config.method == "mean":
            vector = ((partial if partial is not None else 0) + last) / len(request.prompt_token_ids)
        elif self.config.method == "cls":
            vector = partial if partial is not None else last  # a one-token prompt: its last token is its first
        else:
            vector = last
        return F.normalize(vector, dim=-1) if self.config.normalize else vector
