"""The AdamW update math alone, per tensor, in torch ops: the oracle the host step
(``moezero.zero.hostadam.adamw_step_``) and the ``hoststep`` benchmark's vectorised baseline
(``benchmarks.adamw_foreach``) are tested against. It mirrors ``reference/optim.py`` (optax's
``adamw``); test-only, so it lives here and not in the production package.
"""

from __future__ import annotations

import torch


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
