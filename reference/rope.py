"""RoPE inverse frequencies and their YaRN scaling (transformers' ``_compute_yarn_parameters``),
and the attention factor that scales cos and sin. The YaRN frequencies are numpy constants of
the config at trace time; the tables and the rotation (``apply_rope``) are JAX. Torch counterpart: ``torch_impl/model/rope.py``; semantics:
docs/model.md ("gpt-oss's options").
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from moezero.reference.moe import acc_dtype

if TYPE_CHECKING:
    from moezero.reference.model import ModelConfig


def attention_factor(cfg) -> float:
    """The cos/sin scale of ``cfg`` (a ``ModelConfig``): 1 without YaRN; else the explicit
    ``rope_attention_factor``, DeepSeek-V3's ``mscale(f, mscale) / mscale(f, mscale_all_dim)``
    when both are set, or ``0.1 ln(f) + 1`` (1 for f <= 1)."""
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    if cfg.rope_type != "yarn":
        return 1.0
    if cfg.rope_attention_factor is not None:
        return cfg.rope_attention_factor
    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return mscale(cfg.rope_factor, cfg.rope_mscale) / mscale(cfg.rope_factor,
                                                                 cfg.rope_mscale_all_dim)
    return mscale(cfg.rope_factor)


def inv_frequencies(cfg, dim: int) -> np.ndarray:
    """fp32 [dim/2]: ``theta^(-2j/dim)``; with YaRN, interpolated (divided by the factor) below
    the ramp's start, extrapolated above its end, blended linearly in between."""
    half, theta = dim // 2, cfg.rope_theta
    j = np.arange(half, dtype=np.float32)
    base = (theta ** (-j / np.float32(half))).astype(np.float32)
    if cfg.rope_type != "yarn":
        return base

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(cfg.rope_original_max_positions / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))
    low, high = correction_dim(cfg.rope_beta_fast), correction_dim(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((j - low) / (high - low), 0, 1).astype(np.float32)
    return (base / np.float32(cfg.rope_factor) * ramp + base * (1 - ramp)).astype(np.float32)


def rope_tables(seq_len: int, head_dim: int, theta: float,
                cfg: ModelConfig | None = None) -> tuple[jax.Array, jax.Array]:
    """fp32 ``cos, sin`` of shape [S, K/2]: angle = pos · theta^(-2j/K), pos = 0..S-1; with
    ``cfg``: its RoPE type's frequencies and cos/sin scale (``reference/rope.py``)."""
    inv_freq, scale = _frequencies(head_dim, theta, cfg)
    angle_SK2 = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angle_SK2) * scale, jnp.sin(angle_SK2) * scale


def rope_tables_at(positions_BS: jax.Array, head_dim: int, theta: float,
                   cfg: ModelConfig | None = None) -> tuple[jax.Array, jax.Array]:
    """``rope_tables`` at given positions (a document mask's): fp32 [B, S, K/2]."""
    inv_freq, scale = _frequencies(head_dim, theta, cfg)
    angle_BSK2 = positions_BS.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angle_BSK2) * scale, jnp.sin(angle_BSK2) * scale


def _frequencies(head_dim: int, theta: float, cfg: ModelConfig | None):
    """(inverse frequencies [K/2], cos/sin scale): plain RoPE, or ``cfg``'s (YaRN)."""
    if cfg is not None and cfg.rope_type != "default":
        return jnp.asarray(inv_frequencies(cfg, head_dim)), attention_factor(cfg)
    half = head_dim // 2
    return theta ** (-jnp.arange(half, dtype=jnp.float32) / half), 1.0  # as torch computes it


def apply_rope(x_BSHK: jax.Array, cos_SK2: jax.Array, sin_SK2: jax.Array) -> jax.Array:
    """Half-split rotation (HF ``rotate_half``), computed in fp32, cast back to x's dtype.
    The tables are [S, R/2] (positions 0..S-1) or [B, S, R/2] (``rope_tables_at``): the first
    R dims of each head rotate, the rest pass through (partial rotary)."""
    rotary = 2 * cos_SK2.shape[-1]
    if rotary < x_BSHK.shape[-1]:
        rotated = apply_rope(x_BSHK[..., :rotary], cos_SK2, sin_SK2)
        return jnp.concatenate([rotated, x_BSHK[..., rotary:]], -1)
    x32 = x_BSHK.astype(acc_dtype(x_BSHK.dtype))
    half = x32.shape[-1] // 2
    x1, x2 = x32[..., :half], x32[..., half:]
    if cos_SK2.ndim == 2:
        cos_SK2, sin_SK2 = cos_SK2[None], sin_SK2[None]
    cos, sin = cos_SK2[:, :, None, :], sin_SK2[:, :, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x_BSHK.dtype)
