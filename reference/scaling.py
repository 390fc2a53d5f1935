"""fp16 dynamic loss scaling and the clip coefficient of the ZeRO step (``reference/zero.py``).

Torch counterpart: ``moezero.zero.adamw`` (``LossScaler``, ``clip_coef``). Semantics:
docs/design.md, "Semantics" (an overflow skips the step on every rank).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
    """``precision.*`` fp16 keys; ``dynamic=False`` is a fixed scale of 1 (fp32, bf16)."""

    dynamic: bool = False
    initial_scale_power: int = 16
    window: int = 1000  # overflow-free steps before the scale doubles
    hysteresis: int = 2  # overflows absorbed before the scale halves
    min_scale: float = 1.0


class LossScaleState(NamedTuple):
    scale: jax.Array  # fp32
    good_steps: jax.Array  # int32: clean steps since the last overflow
    hysteresis_left: jax.Array  # int32


def init_loss_scale(cfg: LossScaleConfig) -> LossScaleState:
    scale = 2.0 ** cfg.initial_scale_power if cfg.dynamic else 1.0
    return LossScaleState(jnp.float32(scale), jnp.int32(0), jnp.int32(cfg.hysteresis))


def update_loss_scale(cfg: LossScaleConfig, state: LossScaleState, overflow) -> LossScaleState:
    """``LossScaler.update``: on overflow, halve (not below min) once hysteresis is used up;
    after ``window`` clean steps, double and refill the hysteresis."""
    if not cfg.dynamic:
        return state
    scale, good, left = state
    left_o = left - 1
    halve = left_o <= 0
    scale_o = jnp.where(halve, jnp.maximum(scale / 2, cfg.min_scale), scale)
    left_o = jnp.where(halve, cfg.hysteresis, left_o)
    good_c = good + 1
    grow = good_c % cfg.window == 0
    scale_c, left_c = jnp.where(grow, scale * 2, scale), jnp.where(grow, cfg.hysteresis, left)
    return LossScaleState(jnp.where(overflow, scale_o, scale_c).astype(jnp.float32),
                          jnp.where(overflow, 0, good_c).astype(jnp.int32),
                          jnp.where(overflow, left_o, left_c).astype(jnp.int32))


def clip_coef(norm, max_norm: float | None):
    """``max_norm / norm`` when a finite ``norm`` exceeds ``max_norm``, else 1 (optax's rule,
    no epsilon; a non-finite norm is an overflow, which skips the step anyway)."""
    if not max_norm:
        return jnp.float32(1.0)
    return jnp.where(jnp.isfinite(norm) & (norm > max_norm), max_norm / norm, 1.0)
