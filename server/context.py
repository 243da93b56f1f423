"""What request handlers share: settings, the engine, metrics, and the checks every protocol makes alike."""

import logging
from dataclasses import dataclass, field

from kvserve.engine import SamplingParams
from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.sampling_params import GrammarSpec
from kvserve.kvcache import AdapterTag
from kvserve.server.errors import APIError, bad_request
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import RequestModel, SamplingFields
from kvserve.server.settings import ServerSettings

logger = logging.getLogger(__name__)


@dataclass
class ServerContext:
    settings: ServerSettings
    engine: AsyncLLMEngine
    model_name: str
    metrics: ServerMetrics
    _logged_unknown_fields: set[str] = field(default_factory=set)

    def check_model(self, name: str | None) -> None:
        """A 404 in OpenAI's shape unless `name` is the base model or a loaded LoRA adapter (or not given)."""
        self.lora_of(name)

    def lora_of(self, name: str | None) -> AdapterTag | None:
        """The LoRA adapter a request's `model` names (None: the base model); a 404 for a name nothing serves."""
        if name is None or name == self.model_name:
            return None
        tag = self.engine.lora_tag(name)
        if tag is None:
            adapters = [tag.name for tag in self.engine.loaded_loras()]
            served = ", ".join(repr(served) for served in [self.model_name, *adapters])
            raise APIError(
                404, f"model {name!r} does not exist; this server serves {served}",
                type="not_found_error", param="model", code="model_not_found",
            )  # fmt: skip
        return tag

    def check_generates(self, name: str | None) -> None:
        """A 400 naming `model` when the server serves an embedding model (it generates nothing)."""
        if self.engine.pooling is not None:
            model = name or self.model_name
            raise bad_request(f"model {model!r} is an embedding model: it serves /v1/embeddings only", param="model")

    def response_model(self, lora: AdapterTag | None) -> str:
        """The `model` a response names: the adapter's name, or the base model's."""
        return lora.name if lora is not None else self.model_name

    def check_known_fields(self, body: RequestModel) -> None:
        """A 400 naming the fields no model declares, as OpenAI answers a misspelt or unsupported one; with the
        `accept_unknown_fields` setting they are ignored instead (each name logged once, so clients that send other
        vendors' extras keep working)."""
        unknown = body.unknown_fields()
        if not unknown:
            return
        if not self.settings.accept_unknown_fields:
            plural = "s" if len(unknown) > 1 else ""
            raise bad_request(f"Unrecognized request argument{plural} supplied: {', '.join(unknown)}", param=unknown[0])
        for name in set(unknown) - self._logged_unknown_fields:
            logger.warning("ignoring the unknown request field %r (accept_unknown_fields is set)", name)
            self._logged_unknown_fields.add(name)

    def count_disconnect(self) -> None:
        self.metrics.client_disconnects.inc()


def sampling_params(
    body: SamplingFields, max_tokens: int | None, logprobs: int | None, grammar: GrammarSpec | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:  # fmt: skip
    """The fields completions and chat share, as the engine's settings (its input processor checks them)."""
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k is None else body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        seed=body.seed,
        stop=(body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs if prompt_logprobs is not None else body.prompt_logprobs,
        skip_special_tokens=body.skip_special_tokens,
        logit_bias=_logit_bias(body.logit_bias),
        structured_output=grammar,
        speculative_decoding=body.speculative_decoding,
    )


def _logit_bias(biases: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as (id, bias) pairs; the engine checks the ranges."""
    pairs = []
    for key, bias in (biases or {}).items():
        if not key.isdigit():
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        pairs.append((int(key), bias))
    return tuple(pairs)
