"""Supported HF architectures: for each, the model class that runs it and how its config maps onto that class's.

Every architecture supported today is the one Llama-family decoder with switches (`DecoderForCausalLM`); an entry
names its class and its config builder, so a model that is not that decoder (MLA, hybrid attention) is one more
entry, not a branch in the decoder. The builders share `_decoder_config` and set only what their family changes.
"""

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from kvserve.engine.models.decoder import DecoderConfig, DecoderForCausalLM
from kvserve.engine.models.moe import MoeConfig
from kvserve.engine.models.rope import RopeConfig


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its settings is not supported."""


@dataclass(frozen=True)
class Architecture:
    """How one HF architecture is run: `model_class(config, plan, group)` builds it from `build_config(hf_config)`."""

    model_class: type[nn.Module]
    build_config: Callable[[object], DecoderConfig]


def _decoder_config(hf_config, **family) -> DecoderConfig:
    """The fields every supported family reads the same way; `family` sets or overrides the rest."""
    head_dim = _head_dim(hf_config)
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    fields = {
        "vocab_size": hf_config.vocab_size,
        "hidden_size": hf_config.hidden_size,
        "intermediate_size": hf_config.intermediate_size,
        "num_layers": hf_config.num_hidden_layers,
        "num_heads": hf_config.num_attention_heads,
        "num_kv_heads": getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        "head_dim": head_dim,
        "rms_norm_eps": hf_config.rms_norm_eps,
        "max_position_embeddings": _max_positions(hf_config),
        "tie_word_embeddings": bool(getattr(hf_config, "tie_word_embeddings", False)),
        "qkv_bias": attention_bias,
        "o_proj_bias": attention_bias,
        "mlp_bias": bool(getattr(hf_config, "mlp_bias", False)),
        "hidden_act": _hidden_act(hf_config),
    }
    if "rope" not in family:
        rope_parameters = dict(hf_config.rope_parameters or {})
        if rope_parameters.get("rope_type") == "longrope":  # Phi-3's long contexts
            rope_parameters = _longrope_parameters(hf_config, rope_parameters)
        fields["rope"] = _rope_config(head_dim, rope_parameters)
    return DecoderConfig(**{**fields, **family})


def _llama(hf_config) -> DecoderConfig:
    """Llama, Mistral (whose sliding window caps the context: kvserve attends to all of it) and Phi-3 (whose fused
    q/k/v and gate/up checkpoint weights the loader splits)."""
    return _decoder_config(hf_config)


def _qwen2(hf_config) -> DecoderConfig:
    """q/k/v biases (Qwen2-MoE's `qkv_bias`), none on o_proj."""
    return _decoder_config(hf_config, **_qwen2_attention(hf_config))


def _qwen3(hf_config) -> DecoderConfig:
    """RMSNorm over each head of q and k before the rotary embedding."""
    return _decoder_config(hf_config, qk_norm=True)


def _mixtral(hf_config) -> DecoderConfig:
    moe = MoeConfig(
        num_experts=hf_config.num_local_experts,
        top_k=hf_config.num_experts_per_tok,
        intermediate_size=hf_config.intermediate_size,
        renormalize=True,
        sparse_layers=tuple(range(hf_config.num_hidden_layers)),
    )
    # Mixtral's checkpoints name the expert block and its projections differently.
    renames = (
        (".block_sparse_moe.", ".mlp."), (".w1.weight", ".gate_proj.weight"), (".w3.weight", ".up_proj.weight"),
        (".w2.weight", ".down_proj.weight"),
    )  # fmt: skip
    return _decoder_config(hf_config, moe=moe, checkpoint_renames=renames)


def _qwen_moe(hf_config, **family) -> DecoderConfig:
    """Qwen2-MoE and Qwen3-MoE: experts on the layers HF builds them on (a layer has them unless listed in
    mlp_only_layers, every decoder_sparse_step-th), Qwen2-MoE's shared expert."""
    if not hf_config.num_experts:
        return _decoder_config(hf_config, **family)
    step, dense = hf_config.decoder_sparse_step, set(hf_config.mlp_only_layers or ())
    moe = MoeConfig(
        num_experts=hf_config.num_experts,
        top_k=hf_config.num_experts_per_tok,
        intermediate_size=hf_config.moe_intermediate_size,
        renormalize=bool(hf_config.norm_topk_prob),
        sparse_layers=tuple(i for i in range(hf_config.num_hidden_layers) if i not in dense and (i + 1) % step == 0),
        shared_expert_intermediate_size=getattr(hf_config, "shared_expert_intermediate_size", 0) or 0,
    )
    return _decoder_config(hf_config, moe=moe, **family)


def _gemma(hf_config, qk_norm: bool) -> DecoderConfig:
    """Gemma 2 and 3: (1 + weight) norms, scaled embeddings, sandwich norms, the query scale, soft-capping, and
    sliding windows (and, Gemma 3, a rope of their own) on the layers HF's `layer_types` marks."""
    if any(kind not in ("sliding_attention", "full_attention") for kind in hf_config.layer_types):
        raise UnsupportedModelError(f"layer types {sorted(set(hf_config.layer_types))} are not supported")
    head_dim = _head_dim(hf_config)
    rope_parameters = dict(hf_config.rope_parameters or {})
    local_rope = None
    if "full_attention" in rope_parameters:  # Gemma 3: a rope per kind of layer
        local = rope_parameters.get("sliding_attention")
        local_rope = _rope_config(head_dim, dict(local)) if local else None
        rope_parameters = dict(rope_parameters["full_attention"])
    windows = tuple(
        hf_config.sliding_window if layer_type == "sliding_attention" else None for layer_type in hf_config.layer_types
    )
    return _decoder_config(
        hf_config,
        max_position_embeddings=hf_config.max_position_embeddings,
        rope=_rope_config(head_dim, rope_parameters),
        qk_norm=qk_norm,
        norm_weight_offset=1.0,
        embedding_scale=hf_config.hidden_size**0.5,
        sandwich_norms=True,
        attention_scale=hf_config.query_pre_attn_scalar**-0.5,
        attention_softcap=getattr(hf_config, "attn_logit_softcapping", None),
        final_logit_softcap=getattr(hf_config, "final_logit_softcapping", None),
        sliding_windows=windows,
        local_rope=local_rope,
    )


def _qwen2_attention(hf_config) -> dict:
    return {"qkv_bias": bool(getattr(hf_config, "qkv_bias", True)), "o_proj_bias": False}


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(DecoderForCausalLM, _llama),
    "MistralForCausalLM": Architecture(DecoderForCausalLM, _llama),
    "Qwen2ForCausalLM": Architecture(DecoderForCausalLM, _qwen2),
    "Qwen3ForCausalLM": Architecture(DecoderForCausalLM, _qwen3),
    "MixtralForCausalLM": Architecture(DecoderForCausalLM, _mixtral),
    "Qwen2MoeForCausalLM": Architecture(DecoderForCausalLM, lambda hf: _qwen_moe(hf, **_qwen2_attention(hf))),
    "Qwen3MoeForCausalLM": Architecture(DecoderForCausalLM, lambda hf: _qwen_moe(hf, qk_norm=True)),
    "Phi3ForCausalLM": Architecture(DecoderForCausalLM, _llama),
    "Gemma2ForCausalLM": Architecture(DecoderForCausalLM, lambda hf: _gemma(hf, qk_norm=False)),
    "Gemma3ForCausalLM": Architecture(DecoderForCausalLM, lambda hf: _gemma(hf, qk_norm=True)),
}
# The same decoders without their LM head, as sentence-transformers saves an embedding model's transformer (its
# tensors named without the "model." prefix): served for embeddings only.
HEADLESS_ARCHITECTURES = {"LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM",
                          "Qwen2Model": "Qwen2ForCausalLM", "Qwen3Model": "Qwen3ForCausalLM"}  # fmt: skip
ARCHITECTURES.update({name: ARCHITECTURES[causal] for name, causal in HEADLESS_ARCHITECTURES.items()})


def is_headless(architectures: list[str] | None) -> bool:
    """Whether a checkpoint of these architectures (its config's) is a decoder without its LM head (an embedding
    model's transformer)."""
    return any(name in HEADLESS_ARCHITECTURES for name in architectures or [])


def architecture_of(hf_config) -> Architecture:
    """The entry of the first of the config's `architectures` kvserve runs; `UnsupportedModelError` if none."""
    architectures = getattr(hf_config, "architectures", None) or []
    name = next((name for name in architectures if name in ARCHITECTURES), None)
    if name is None:
        raise UnsupportedModelError(
            f"architectures {architectures} not supported; kvserve runs {', '.join(ARCHITECTURES)}"
        )
    return ARCHITECTURES[name]


def decoder_config_from_hf(hf_config) -> DecoderConfig:
    """The kvserve config of a transformers `PreTrainedConfig` of a supported architecture."""
    return architecture_of(hf_config).build_config(hf_config)


def _hidden_act(hf_config) -> str:
    hidden_act = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", "silu")
    if hidden_act not in ("silu", "gelu_pytorch_tanh"):
        raise UnsupportedModelError(f"hidden_act {hidden_act!r} is not supported (silu, gelu_pytorch_tanh)")
    return hidden_act


def _head_dim(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def _rope_config(head_dim: int, rope_parameters: dict) -> RopeConfig:
    if rope_parameters.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor != 1 is not supported")
    return RopeConfig(
        head_dim=head_dim,
        theta=float(rope_parameters.get("rope_theta", 10000.0)),
        rope_type=rope_parameters.get("rope_type", "default"),
        parameters=rope_parameters,
    )


def _longrope_parameters(hf_config, rope_parameters: dict) -> dict:
    """As HF reads them: the original context from the rope dict or the config, and the extension factor
    from the two context lengths where the dict does not give it."""
    original_len = rope_parameters.get("original_max_position_embeddings") or hf_config.original_max_position_embeddings
    factor = rope_parameters.get("factor") or hf_config.max_position_embeddings / original_len
    return {**rope_parameters, "original_max_position_embeddings": original_len, "factor": factor}


def _max_positions(hf_config) -> int:
    """Context window; a sliding window caps it, since kvserve attends to the full context."""
    max_positions = hf_config.max_position_embeddings
    sliding_window = getattr(hf_config, "sliding_window", None)
    uses_sliding_window = getattr(hf_config, "use_sliding_window", True)
    if sliding_window and uses_sliding_window:
        max_positions = min(max_positions, sliding_window)
    return max_positions
