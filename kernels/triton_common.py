"""Choices shared by the Triton kernel wrappers: how `tl.dot` is fed, tile extents, int8 scale arguments,
sliding-window and soft-cap constexprs."""

import os

import torch
import triton

from kvserve.kernels.paged_kv import PagedKV


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether `tl.dot` must take fp32 operands: fp32 data, or the interpreter, which cannot multiply
    16-bit floats in `tl.dot`. 16-bit data upcast to fp32 is exact, so only speed differs."""
    return dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 products in full precision; TF32 would round fp32 data to 10 mantissa bits."""
    return "ieee" if dot_in_fp32(dtype) else "tf32"


def padded(n: int, minimum: int = 16) -> int:
    """A power-of-two tile extent >= n; `tl.dot` needs each dimension >= 16."""
    return max(minimum, triton.next_power_of_2(n))


def scale_args(cache: PagedKV) -> tuple:
    """Scale tensors and their strides; a 16-bit cache passes its data tensors, which are never read as scales."""
    if cache.quantized:
        return cache.key_scale, cache.value_scale, cache.key_scale.stride(), cache.value_scale.stride()
    return cache.key, cache.value, (0, 0, 0), (0, 0, 0)


def attention_options(sliding_window: int | None, logit_softcap: float | None) -> dict:
    """The attention kernels' constexprs for Gemma's per-layer options: SLIDING_WINDOW W (0: none; a query at
    position i sees keys at i - W + 1 ... i) and LOGIT_SOFTCAP c (0.0: none; scores s become c * tanh(s / c)).
    Compile-time values: the variant without them compiles to the code of kernels that lack them, and a model
    compiles one variant per (window, cap) pair its layers use."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
    if logit_softcap is not None and not logit_softcap > 0:
        raise ValueError(f"logit_softcap must be positive, got {logit_softcap}")
    return {"SLIDING_WINDOW": sliding_window or 0, "LOGIT_SOFTCAP": float(logit_softcap or 0.0)}
