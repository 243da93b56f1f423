"""`LLM`: the offline API — give it prompts, get back finished outputs in order."""

from collections.abc import Sequence
from dataclasses import replace

from kvserve.engine.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.outputs import RequestDelta, RequestOutput
from kvserve.engine.request import CoreRequest, GenerationRequest
from kvserve.engine.sampling_params import SamplingParams


class LLM:
    """With `tensor_parallel_size` > 1 the other ranks are processes of their own: `close()` them (or use
    `with LLM(...) as llm:`); they also end when this process does."""

    def __init__(self, model: str | None = None, **config_overrides) -> None:
        self.engine = LLMEngine(replace(EngineConfig(model=model), **config_overrides))

    def close(self) -> None:
        self.engine.close()

    def load_lora(self, name: str, path: str) -> None:
        """Load a PEFT LoRA adapter under `name` (the engine needs `enable_lora=True`)."""
        self.engine.load_lora(name, path)

    def unload_lora(self, name: str) -> bool:
        return self.engine.unload_lora(name)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_names: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts through the continuously batched engine; outputs come back in prompt order.
        `lora_names`: the loaded LoRA adapter each prompt runs under (one name for all; None: the base model)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        if lora_names is None or isinstance(lora_names, str):
            lora_names = [lora_names] * len(prompts)
        if len(lora_names) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(lora_names)} LoRA names")
        # Every prompt is checked before any is queued: a bad one refuses the call and runs nothing.
        inputs = self.engine.inputs
        requests = []
        for prompt, prompt_params, lora_name in zip(prompts, params_list, lora_names, strict=True):
            prompt = prompt if isinstance(prompt, str) else list(prompt)
            lora = self.engine.lora_tag(lora_name)
            processed = inputs.process(GenerationRequest([prompt], prompt_params, lora=lora))
            request_id = self.engine.new_request_id()
            requests.append(CoreRequest(request_id, processed.prompt_token_ids[0], processed.params[0], lora=lora))
        for request in requests:
            self.engine.submit(request)
        deltas: dict[str, list[RequestDelta]] = {request.request_id: [] for request in requests}
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                deltas[delta.request_id].append(delta)
        outputs = []
        for request in requests:
            whole = RequestDelta.merge(deltas[request.request_id])
            outputs.append(RequestOutput(request.request_id, request.prompt_token_ids, whole.token_ids, whole.text,
                                         whole.logprobs, whole.finish_reason, whole.prompt_logprobs))  # fmt: skip
        return outputs
