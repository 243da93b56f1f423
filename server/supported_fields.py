"""OpenAI request fields kvserve does not serve: each refused with a 400 that names it, never ignored.

Fields are refused only when set to something that would change the answer: `store: false`,
`service_tier: "auto"` or `modalities: ["text"]` ask for what kvserve does anyway.

Routers (vllm-router, sglang-router) forward requests re-serialized with SGLang's and vLLM's fields at their
defaults: `no_stop_trim: false` and `return_hidden_states: false` everywhere, and on chat `continue_final_message:
false`, `separate_reasoning`, `stream_reasoning` and `include_reasoning: true`. The first three are served at those
values only. The reasoning fields act only where a reasoning parser splits the model's reasoning from its answer;
kvserve has none, so the whole output is the content, as it is in vLLM and SGLang without `--reasoning-parser`:
not separating and not streaming reasoning apart is what every value of those two gets, while `include_reasoning:
false` (drop the reasoning) cannot be served and is refused.
"""

from kvserve.server.errors import bad_request
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

_REFUSED_CHAT_FIELDS = {
    "audio": "audio output is not supported: this model is text-only",
    "function_call": "`function_call` is deprecated by OpenAI and not supported; use `tool_choice`",
    "functions": "`functions` is deprecated by OpenAI and not supported; use `tools`",
    "metadata": "`metadata` is kept with stored completions, and kvserve stores none",
    "moderation": "moderation is not supported",
    "prediction": "predicted outputs are not supported",
    "prompt_cache_options": "prompt cache options are not supported: the prefix cache is automatic and has no TTL",
    "prompt_cache_retention": "prompt cache retention is not supported: the prefix cache is automatic and has no TTL",
    "reasoning_effort": "this model does not reason: `reasoning_effort` is not supported",
    "verbosity": "`verbosity` is not supported",
    "web_search_options": "web search is not supported",
}
_SERVED_SERVICE_TIERS = (None, "auto", "default")


def check_sampling_fields(body: SamplingFields) -> None:
    if body.no_stop_trim:
        raise bad_request("stop strings are always cut from the text", param="no_stop_trim")
    if body.return_hidden_states:
        raise bad_request("hidden states are not returned", param="return_hidden_states")
    if body.stream_options is not None and body.stream_options.include_obfuscation:
        raise bad_request("stream obfuscation is not supported", param="stream_options.include_obfuscation")
    if body.prompt_logprobs is not None and body.stream:
        raise bad_request("prompt_logprobs are returned only without stream", param="prompt_logprobs")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options needs stream: true", param="stream_options")


def check_completion_fields(body: CompletionRequest) -> None:
    check_sampling_fields(body)
    if body.max_tokens == 0 and not body.echo:
        raise bad_request("max_tokens 0 returns nothing without echo", param="max_tokens")
    if body.suffix:
        raise bad_request("`suffix` (fill-in-the-middle) is not supported by this model's template", param="suffix")


def check_chat_fields(body: ChatCompletionRequest) -> None:
    check_sampling_fields(body)
    for name, reason in _REFUSED_CHAT_FIELDS.items():
        if getattr(body, name) is not None:
            raise bad_request(reason, param=name)
    if body.modalities is not None and body.modalities != ["text"]:
        raise bad_request('only modalities ["text"] is supported: this model is text-only', param="modalities")
    if body.service_tier not in _SERVED_SERVICE_TIERS:
        raise bad_request(f"service_tier {body.service_tier!r} is not supported; use 'auto'", param="service_tier")
    if body.store:
        raise bad_request("kvserve does not store completions: `store` must be false", param="store")
    if body.continue_final_message:
        raise bad_request("continuing the final message is not supported", param="continue_final_message")
    if not body.include_reasoning:
        raise bad_request(
            "kvserve has no reasoning parser: reasoning cannot be told from the answer and left out",
            param="include_reasoning",
        )
