"""The inference engine: model runner, sampler, detokenizer, LLMEngine and the offline LLM API."""

from kvserve.engine.config import EngineConfig
from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.llm import LLM
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.outputs import RequestDelta, RequestOutput, TokenLogprob
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.speculative import SpeculativeConfig

__all__ = [
    "LLM",
    "EngineConfig",
    "InvalidRequestError",
    "LLMEngine",
    "RequestDelta",
    "RequestOutput",
    "SamplingParams",
    "SpeculativeConfig",
    "TokenLogprob",
]
