"""`LLM`: the offline API — give it prompts, get back finished outputs in order."""

from collections.abc import Sequence
from dataclasses import replace

from kvserve.engine.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.outputs import RequestDelta, RequestOutput
from kvserve.engine.sampling_params import SamplingParams


class LLM:
    """With `tensor_parallel_size` > 1 the other ranks are processes of their own: `close()` them (or use
    `with LLM(...) as llm:`); they also end when this process does."""

    def __init__(self, model: str | None = None, **config_overrides) -> None:
        self.engine = LLMEngine(replace(EngineConfig(model=model), **config_overrides))

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts through the continuously batched engine; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        request_ids = []
        try:
            for prompt, prompt_params in zip(prompts, params_list, strict=True):
                prompt = prompt if isinstance(prompt, str) else list(prompt)
                request_ids.append(self.engine.add_request(prompt, prompt_params))
        except Exception:
            for request_id in request_ids:
                self.engine.abort(request_id)
            raise
        deltas: dict[str, list[RequestDelta]] = {request_id: [] for request_id in request_ids}
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                deltas[delta.request_id].append(delta)
        outputs = []
        for request_id, prompt in zip(request_ids, prompts, strict=True):
            whole = RequestDelta.merge(deltas[request_id])
            prompt_token_ids = self.engine.tokenize_prompt(prompt) if isinstance(prompt, str) else list(prompt)
            outputs.append(RequestOutput(request_id, prompt_token_ids, whole.token_ids, whole.text, whole.logprobs,
                                         whole.finish_reason, whole.prompt_logprobs))  # fmt: skip
        return outputs
