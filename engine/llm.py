"""`LLM`: the offline API — give it prompts, get back finished outputs in order."""

from collections.abc import Sequence
from dataclasses import replace

from kvserve.engine.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.outputs import RequestDelta, RequestOutput
from kvserve.engine.pooling import EMBEDDING_PARAMS
from kvserve.engine.request import ChatPrompt, CoreRequest, GenerationRequest
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
        priority: int | Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts through the continuously batched engine; outputs come back in prompt order.
        `lora_names`: the loaded LoRA adapter each prompt runs under (one name for all; None: the base model).
        `priority`: each prompt's priority (one for all; vLLM's list), lower first; the engine needs
        `scheduling_policy="priority"` for any but 0."""
        prompts = _prompt_list(prompts)
        params = sampling_params or SamplingParams()
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        lora_names = [lora_names] * len(prompts) if lora_names is None or isinstance(lora_names, str) else lora_names
        priority = 0 if priority is None else priority
        priorities = [priority] * len(prompts) if isinstance(priority, int) else priority
        for name, values in (("sampling params", params_list), ("LoRA names", lora_names), ("priorities", priorities)):
            if len(values) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(values)} {name}")
        # Every prompt is checked before any is queued: a bad one refuses the call and runs nothing.
        requests = [self._checked(*each) for each in zip(prompts, params_list, lora_names, priorities, strict=True)]
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

    def embed(self, prompts: str | Sequence[str] | Sequence[Sequence[int]]) -> list[list[float]]:
        """Each prompt's embedding, in order (an engine of `task="embed"`, or a sentence-transformers model)."""
        if not self.engine.core.embeds:
            raise ValueError("this engine generates: embeddings need an embedding model (task='embed')")
        pooling = self.engine.core.pooler.config
        prompts = [pooling.prompt(prompt) if isinstance(prompt, str) else prompt for prompt in _prompt_list(prompts)]
        requests = [self._checked(prompt, EMBEDDING_PARAMS, None, 0) for prompt in prompts]
        for request in requests:
            self.engine.submit(request)
        vectors: dict[str, list[float]] = {}
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                if delta.embedding is not None:
                    vectors[delta.request_id] = delta.embedding
        return [vectors[request.request_id] for request in requests]

    def _checked(self, prompt, params: SamplingParams, lora_name: str | None, priority: int) -> CoreRequest:
        """One prompt through the input processor, as the core queues it."""
        prompt = prompt if isinstance(prompt, str | ChatPrompt) else list(prompt)
        lora = self.engine.lora_tag(lora_name)
        processed = self.engine.inputs.process(GenerationRequest([prompt], params, lora=lora, priority=priority))
        token_ids, params = processed.prompt_token_ids[0], processed.params[0]
        return CoreRequest(self.engine.new_request_id(), token_ids, params, None, lora, processed.priority)


def _prompt_list(prompts):
    """One prompt (a text, or a list of token ids) as a list of one; a list of prompts as it is."""
    return [prompts] if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) else prompts
