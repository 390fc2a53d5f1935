"""Optimizer math around the AdamW update: the LR schedule, clipping, dynamic loss scaling.

They mirror ``reference/optim.py`` (``clip_by_global_norm`` and a warmup + cosine schedule)
and ``reference/scaling.py``, so the sharded step can apply them one optimizer group at a
time. The update itself is ``moezero.zero.hostadam.adamw_step_`` (one pass; its per-tensor
oracle, the reference's math in torch ops, is ``tests/support/adamw.py: adamw_``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def lr_at(step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Linear warmup from 0 to ``lr`` over ``warmup_steps``, then cosine to ``lr*min_lr_ratio``.

    ``step`` counts optimizer steps from 0 (the first step uses ``lr_at(0)``).
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = max(total_steps - warmup_steps, 1)
    progress = min((step - warmup_steps) / decay_steps, 1.0)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * cosine)


def clip_coef(grad_norm: float, max_norm: float | None) -> float:
    """Factor that scales gradients to at most ``max_norm`` (optax semantics, no epsilon)."""
    if not max_norm or grad_norm <= max_norm or not math.isfinite(grad_norm):
        return 1.0
    return max_norm / grad_norm


@dataclass
class LossScaler:
    """DeepSpeed-style dynamic loss scale for fp16; a fixed scale of 1 otherwise.

    On overflow: the step is skipped and, once ``hysteresis`` overflows have been absorbed, the
    scale halves (not below ``min_scale``). After ``window`` clean steps it doubles.
    """

    scale: float = 1.0
    dynamic: bool = False
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    good_steps: int = 0
    hysteresis_left: int = 2

    @classmethod
    def from_config(cls, precision) -> LossScaler:
        if precision.dtype != "fp16":
            return cls()
        return cls(scale=2.0 ** precision.initial_scale_power, dynamic=True,
                   window=precision.loss_scale_window, hysteresis=precision.hysteresis,
                   min_scale=precision.min_loss_scale, hysteresis_left=precision.hysteresis)

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self.good_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
                self.hysteresis_left = self.hysteresis
            return
        self.good_steps += 1
        if self.good_steps % self.window == 0:
            self.scale *= 2.0
            self.hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps,
                "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.hysteresis_left = int(state["hysteresis_left"])
