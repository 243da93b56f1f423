"""The inference engine: model runner, sampler, detokenizer, LLMEngine and the offline LLM API."""

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import RequestDelta, RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "EngineConfig",
    "InvalidRequestError",
    "LLMEngine",
    "RequestDelta",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
]
