"""Rotary position embeddings: inverse frequencies for the rope types Llama, Mistral, Qwen and Phi-3 use.

Phi-3's LongRoPE has two sets of frequencies: a sequence longer than the model's original context rotates all
its tokens with the long set, the others with the short set. HF recomputes a sequence's whole cache when it
grows past that length, and so does the engine (`LLMEngine`). The tables hold the short rows, then the long
ones: the step's inputs point each token at its row (`RotaryEmbedding.long_rope`).
"""

import math
from dataclasses import dataclass, field

import torch

from kvserve.kernels import KernelBackend


class UnsupportedRopeError(ValueError):
    """The checkpoint asks for a rope type kvserve does not implement."""


@dataclass(frozen=True)
class RopeConfig:
    """`parameters` is the checkpoint's rope dict (HF `rope_parameters`: rope_type, factor, ...)."""

    head_dim: int
    theta: float
    rope_type: str = "default"
    parameters: dict = field(default_factory=dict)


def inverse_frequencies(config: RopeConfig) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [head_dim // 2], attention_factor that scales cos and sin)."""
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
    inv_freq = 1.0 / (config.theta**exponents)
    params = config.parameters
    if config.rope_type == "default":
        return inv_freq, 1.0
    if config.rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if config.rope_type == "llama3":
        return _llama3(inv_freq, params), 1.0
    if config.rope_type == "yarn":
        return _yarn(config, params)
    if config.rope_type == "longrope":
        return _longrope(exponents, config, long=False)
    raise UnsupportedRopeError(
        f"rope type {config.rope_type!r} is not supported (default, linear, llama3, yarn, longrope)"
    )


def _longrope(exponents: torch.Tensor, config: RopeConfig, long: bool) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): per-frequency factors, short or long; attention scaled by the context's extension."""
    params = config.parameters
    factors = torch.tensor(params["long_factor" if long else "short_factor"], dtype=torch.float32)
    factor, original_len = params["factor"], params["original_max_position_embeddings"]
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_len))
    return 1.0 / (factors * config.theta**exponents), float(attention_factor)


def long_rope_frequencies(config: RopeConfig) -> tuple[torch.Tensor, float]:
    """LongRoPE's long set (for sequences past the original context)."""
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
    return _longrope(exponents, config, long=True)


def _llama3(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short kept, a smooth blend between."""
    factor = params["factor"]
    low_freq_factor, high_freq_factor = params["low_freq_factor"], params["high_freq_factor"]
    original_len = params["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    blend = (original_len / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - blend) * inv_freq / factor + blend * inv_freq
    scaled = torch.where(wavelength > original_len / low_freq_factor, inv_freq / factor, blended)
    return torch.where(wavelength < original_len / high_freq_factor, inv_freq, scaled)


def _yarn(config: RopeConfig, params: dict) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between; scale attention."""
    dim, base = config.head_dim, config.theta
    factor = params["factor"]
    original_len = params["original_max_position_embeddings"]
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor, 1.0)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(original_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    position_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated, interpolated = 1.0 / position_freqs, 1.0 / (factor * position_freqs)
    inv_freq = interpolated * ramp + extrapolated * (1 - ramp)
    return inv_freq, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables [max_positions, head_dim] in fp32, applied by the backend to packed
    [num_tokens, heads, head_dim] queries and keys."""

    def __init__(self, config: RopeConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.max_positions = max_positions
        num_rows = 2 * max_positions if config.rope_type == "longrope" else max_positions
        self.register_buffer("cos", torch.empty(num_rows, config.head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(num_rows, config.head_dim), persistent=False)
        self.compute_tables()

    @property
    def long_rope(self) -> tuple[int, int] | None:
        """LongRoPE: (the original context: longer sequences take the long rows, the long rows' offset)."""
        if self.config.rope_type != "longrope":
            return None
        return self.config.parameters["original_max_position_embeddings"], self.max_positions

    def compute_tables(self) -> None:
        """Fill cos and sin, in fp32, on the tables' device; a model built on the meta device calls
        this again once its buffers are allocated (and after a cast to another dtype)."""
        device = self.cos.device
        if device.type == "meta":
            return
        frequency_sets = [inverse_frequencies(self.config)]
        if self.long_rope is not None:
            frequency_sets.append(long_rope_frequencies(self.config))
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        cos, sin = [], []
        for inv_freq, attention_factor in frequency_sets:
            angles = torch.outer(positions, inv_freq.to(device))
            angles = torch.cat([angles, angles], dim=-1)
            cos.append(angles.cos() * attention_factor)
            sin.append(angles.sin() * attention_factor)
        self.cos, self.sin = torch.cat(cos), torch.cat(sin)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, backend: KernelBackend):
        return backend.rotary_embedding(positions, query, key, self.cos, self.sin)
