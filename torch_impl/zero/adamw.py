"""Optimizer math as free functions: AdamW, the LR schedule, clipping, dynamic loss scaling.

They act on fp32 tensors in place and mirror ``reference/optim.py`` (optax's ``adamw``,
``clip_by_global_norm`` and a warmup + cosine schedule), so the sharded step can apply them to
any slice of state, one optimizer group at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


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


def adamw_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
           exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float, beta2: float,
           eps: float, weight_decay: float) -> None:
    """One AdamW update in place on fp32 tensors; ``step`` is 1-based (bias correction).

    update = m̂ / (sqrt(v̂) + eps) + weight_decay * param; param -= lr * update (optax adamw).
    """
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    m_hat = exp_avg / (1.0 - beta1 ** step)
    denom = (exp_avg_sq / (1.0 - beta2 ** step)).sqrt_().add_(eps)
    update = m_hat.div_(denom)
    if weight_decay:
        update.add_(param, alpha=weight_decay)
    param.add_(update, alpha=-lr)


def adamw_foreach_(params: list[torch.Tensor], grads: list[torch.Tensor],
                   exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], *, step: int,
                   lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """``adamw_`` on lists of fp32 tensors sharing one set of hyperparameters, one
    ``torch._foreach_*`` call per operation (the offloaded tiers' host step, a window of groups
    at a time). The same operations in the same order: on CPU, bit for bit ``adamw_`` of each
    tensor (tests/torch_impl/test_host_step.py)."""
    if not params:
        return
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
    updates = torch._foreach_div(exp_avgs, 1.0 - beta1 ** step)
    denoms = torch._foreach_div(exp_avg_sqs, 1.0 - beta2 ** step)
    torch._foreach_sqrt_(denoms)
    torch._foreach_add_(denoms, eps)
    torch._foreach_div_(updates, denoms)
    if weight_decay:
        torch._foreach_add_(updates, params, alpha=weight_decay)
    torch._foreach_add_(params, updates, alpha=-lr)


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
