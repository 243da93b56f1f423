"""Builds PEFT LoRA adapters for a test checkpoint: PEFT's own `get_peft_model` and `save_pretrained`, with seeded
random A and B (PEFT starts B at zero, which would make every adapter a no-op)."""

from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM


def write_peft_adapter(base_dir: Path, out_dir: Path, seed: int, scale: float = 0.2, **lora_config) -> Path:
    """Save an adapter of `base_dir`'s model to `out_dir`; `lora_config` goes to PEFT's `LoraConfig` (r, lora_alpha,
    target_modules, use_rslora, rank_pattern, alpha_pattern, ...)."""
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(**lora_config))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
    model.save_pretrained(out_dir)
    return out_dir
