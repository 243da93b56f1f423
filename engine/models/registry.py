"""Supported HF architectures and how their configs map onto `DecoderConfig`."""

from engine.models.decoder import DecoderConfig
from engine.models.rope import RopeConfig


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its settings is not supported."""


SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# Qwen2 always has q/k/v biases and no o_proj bias; the others follow `attention_bias` for all four.
_QWEN2 = "Qwen2ForCausalLM"
_QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM",)


def decoder_config_from_hf(hf_config) -> DecoderConfig:
    """Build a `DecoderConfig` from a transformers `PreTrainedConfig` of a supported architecture."""
    architectures = getattr(hf_config, "architectures", None) or []
    architecture = next((name for name in architectures if name in SUPPORTED_ARCHITECTURES), None)
    if architecture is None:
        raise UnsupportedModelError(
            f"architectures {architectures} not supported; kvserve runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {hf_config.hidden_act!r} is not supported (only silu)")
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    rope_parameters = dict(hf_config.rope_parameters or {})
    if rope_parameters.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor != 1 is not supported")
    return DecoderConfig(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=hf_config.rms_norm_eps,
        max_position_embeddings=_max_positions(hf_config),
        rope=RopeConfig(
            head_dim=head_dim,
            theta=float(rope_parameters.get("rope_theta", 10000.0)),
            rope_type=rope_parameters.get("rope_type", "default"),
            parameters=rope_parameters,
        ),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=architecture == _QWEN2 or attention_bias,
        o_proj_bias=architecture != _QWEN2 and attention_bias,
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        qk_norm=architecture in _QK_NORM_ARCHITECTURES,
    )


def _max_positions(hf_config) -> int:
    """Context window; a sliding window caps it, since kvserve attends to the full context."""
    max_positions = hf_config.max_position_embeddings
    sliding_window = getattr(hf_config, "sliding_window", None)
    uses_sliding_window = getattr(hf_config, "use_sliding_window", True)
    if sliding_window and uses_sliding_window:
        max_positions = min(max_positions, sliding_window)
    return max_positions
