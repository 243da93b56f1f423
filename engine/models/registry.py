"""Supported HF architectures and how their configs map onto `DecoderConfig`."""

from kvserve.engine.models.decoder import DecoderConfig
from kvserve.engine.models.moe import MoeConfig
from kvserve.engine.models.rope import RopeConfig


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its settings is not supported."""


SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Phi3ForCausalLM",
    "Gemma2ForCausalLM", "Gemma3ForCausalLM",
)  # fmt: skip
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Qwen2 and Qwen2-MoE have q/k/v biases (Qwen2-MoE's `qkv_bias`) and no o_proj bias; the others follow
# `attention_bias` for all four.
_QWEN2_ATTENTION = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
_QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")
_QWEN_MOE = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
# Mixtral's checkpoints name the expert block and its projections differently.
_MIXTRAL_RENAMES = (
    (".block_sparse_moe.", ".mlp."), (".w1.weight", ".gate_proj.weight"), (".w3.weight", ".up_proj.weight"),
    (".w2.weight", ".down_proj.weight"),
)  # fmt: skip


def decoder_config_from_hf(hf_config) -> DecoderConfig:
    """Build a `DecoderConfig` from a transformers `PreTrainedConfig` of a supported architecture."""
    architectures = getattr(hf_config, "architectures", None) or []
    architecture = next((name for name in architectures if name in SUPPORTED_ARCHITECTURES), None)
    if architecture is None:
        raise UnsupportedModelError(
            f"architectures {architectures} not supported; kvserve runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    gemma = architecture in _GEMMA
    hidden_act = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", "silu")
    if hidden_act not in ("silu", "gelu_pytorch_tanh"):
        raise UnsupportedModelError(f"hidden_act {hidden_act!r} is not supported (silu, gelu_pytorch_tanh)")
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    rope_parameters = dict(hf_config.rope_parameters or {})
    local_rope_parameters = None
    if "full_attention" in rope_parameters:  # Gemma 3: a rope per kind of layer
        local_rope_parameters = rope_parameters.get("sliding_attention")
        rope_parameters = dict(rope_parameters["full_attention"])
    if rope_parameters.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor != 1 is not supported")
    if rope_parameters.get("rope_type") == "longrope":
        rope_parameters = _longrope_parameters(hf_config, rope_parameters)
    return DecoderConfig(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=hf_config.rms_norm_eps,
        max_position_embeddings=hf_config.max_position_embeddings if gemma else _max_positions(hf_config),
        rope=_rope_config(head_dim, rope_parameters),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=bool(getattr(hf_config, "qkv_bias", True)) if architecture in _QWEN2_ATTENTION else attention_bias,
        o_proj_bias=architecture not in _QWEN2_ATTENTION and attention_bias,
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        qk_norm=architecture in _QK_NORM_ARCHITECTURES,
        moe=_moe_config(architecture, hf_config),
        checkpoint_renames=_MIXTRAL_RENAMES if architecture == "MixtralForCausalLM" else (),
        hidden_act=hidden_act,
        **(_gemma_switches(hf_config, head_dim, local_rope_parameters) if gemma else {}),
    )


def _rope_config(head_dim: int, rope_parameters: dict) -> RopeConfig:
    return RopeConfig(
        head_dim=head_dim,
        theta=float(rope_parameters.get("rope_theta", 10000.0)),
        rope_type=rope_parameters.get("rope_type", "default"),
        parameters=rope_parameters,
    )


def _gemma_switches(hf_config, head_dim: int, local_rope_parameters: dict | None) -> dict:
    """Gemma 2 and 3: (1 + weight) norms, scaled embeddings, sandwich norms, the query scale, soft-capping, and
    sliding windows (and, Gemma 3, a rope of their own) on the layers HF's `layer_types` marks."""
    windows = tuple(
        hf_config.sliding_window if layer_type == "sliding_attention" else None for layer_type in hf_config.layer_types
    )
    if any(kind not in ("sliding_attention", "full_attention") for kind in hf_config.layer_types):
        raise UnsupportedModelError(f"layer types {sorted(set(hf_config.layer_types))} are not supported")
    return {
        "norm_weight_offset": 1.0,
        "embedding_scale": hf_config.hidden_size**0.5,
        "sandwich_norms": True,
        "attention_scale": hf_config.query_pre_attn_scalar**-0.5,
        "attention_softcap": getattr(hf_config, "attn_logit_softcapping", None),
        "final_logit_softcap": getattr(hf_config, "final_logit_softcapping", None),
        "sliding_windows": windows,
        "local_rope": _rope_config(head_dim, dict(local_rope_parameters)) if local_rope_parameters else None,
    }


def _longrope_parameters(hf_config, rope_parameters: dict) -> dict:
    """As HF reads them: the original context from the rope dict or the config, and the extension factor
    from the two context lengths where the dict does not give it."""
    original_len = rope_parameters.get("original_max_position_embeddings") or hf_config.original_max_position_embeddings
    factor = rope_parameters.get("factor") or hf_config.max_position_embeddings / original_len
    return {**rope_parameters, "original_max_position_embeddings": original_len, "factor": factor}


def _moe_config(architecture: str, hf_config) -> MoeConfig | None:
    num_layers = hf_config.num_hidden_layers
    if architecture == "MixtralForCausalLM":
        return MoeConfig(
            num_experts=hf_config.num_local_experts,
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.intermediate_size,
            renormalize=True,
            sparse_layers=tuple(range(num_layers)),
        )
    if architecture not in _QWEN_MOE or not hf_config.num_experts:
        return None
    # As HF builds them: a layer has experts unless listed in mlp_only_layers, every decoder_sparse_step-th.
    step, dense = hf_config.decoder_sparse_step, set(hf_config.mlp_only_layers or ())
    return MoeConfig(
        num_experts=hf_config.num_experts,
        top_k=hf_config.num_experts_per_tok,
        intermediate_size=hf_config.moe_intermediate_size,
        renormalize=bool(hf_config.norm_topk_prob),
        sparse_layers=tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0),
        shared_expert_intermediate_size=getattr(hf_config, "shared_expert_intermediate_size", 0) or 0,
    )


def _max_positions(hf_config) -> int:
    """Context window; a sliding window caps it, since kvserve attends to the full context."""
    max_positions = hf_config.max_position_embeddings
    sliding_window = getattr(hf_config, "sliding_window", None)
    uses_sliding_window = getattr(hf_config, "use_sliding_window", True)
    if sliding_window and uses_sliding_window:
        max_positions = min(max_positions, sliding_window)
    return max_positions
