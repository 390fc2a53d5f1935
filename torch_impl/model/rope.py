"""RoPE frequencies and their YaRN scaling, as transformers computes them
(``modeling_rope_utils._compute_yarn_parameters``): the inverse frequencies blend
interpolation (divided by ``factor``) and extrapolation over a linear ramp between the
correction dims of ``beta_fast`` and ``beta_slow`` rotations; cos and sin are scaled by the
attention factor (``0.1 ln(factor) + 1``, or DeepSeek-V3's ratio of two ``mscale`` terms).

The rotation itself is ``moezero.model.attention.rope``; the JAX counterpart is
``reference/rope.py``. Semantics: docs/model.md ("gpt-oss's options").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROPE_TYPES = ("default", "yarn")


@dataclass(frozen=True)
class Yarn:
    """YaRN's settings (``model.rope_*``; transformers' ``rope_parameters`` of type yarn)."""

    factor: float
    original_max_positions: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(yarn: Yarn | None) -> float:
    """The cos/sin scale: explicit, else ``mscale(f, mscale) / mscale(f, mscale_all_dim)`` when
    both are set and non-zero (DeepSeek-V3), else ``mscale(f)``; 1 without YaRN."""
    if yarn is None:
        return 1.0
    if yarn.attention_factor is not None:
        return yarn.attention_factor
    if yarn.mscale and yarn.mscale_all_dim:
        return float(_mscale(yarn.factor, yarn.mscale) / _mscale(yarn.factor, yarn.mscale_all_dim))
    return _mscale(yarn.factor)


def correction_range(yarn: Yarn, dim: int, theta: float) -> tuple[float, float]:
    """The dims (of ``dim/2`` frequencies) where the ramp starts and ends."""
    def at(rotations: float) -> float:
        return (dim * math.log(yarn.original_max_positions / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))
    low, high = at(yarn.beta_fast), at(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def inv_frequencies(dim: int, theta: float, yarn: Yarn | None = None,
                    device: torch.device | None = None) -> torch.Tensor:
    """fp32 [dim/2] inverse frequencies ``theta^(-2j/dim)``, YaRN-blended when ``yarn``."""
    half = dim // 2
    if yarn is None:
        return theta ** (-torch.arange(half, dtype=torch.float32, device=device) / half)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (yarn.factor * pos_freqs)
    low, high = correction_range(yarn, dim, theta)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(half, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of extrapolation
    return interpolation * (1 - keep) + extrapolation * keep
