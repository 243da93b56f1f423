"""Model definitions that take explicit attention metadata, and the registry of supported architectures."""

from kvserve.engine.models.decoder import DecoderConfig, DecoderForCausalLM
from kvserve.engine.models.registry import ARCHITECTURES, UnsupportedModelError, architecture_of, decoder_config_from_hf

__all__ = [
    "ARCHITECTURES",
    "DecoderConfig",
    "DecoderForCausalLM",
    "UnsupportedModelError",
    "architecture_of",
    "decoder_config_from_hf",
]
