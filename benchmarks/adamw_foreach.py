"""``adamw_foreach_``: the vectorised AdamW the offloaded step ran before issue 28, kept as the
``hoststep`` series' baseline (``benchmarks.hoststep``: its ``adamw_foreach_`` row and
``legacy_step``). Benchmark-only: production steps with ``moezero.zero.hostadam.adamw_step_``.
"""

from __future__ import annotations

import torch


def adamw_foreach_(params: list[torch.Tensor], grads: list[torch.Tensor],
                   exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], *, step: int,
                   lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """AdamW on lists of fp32 tensors sharing one set of hyperparameters, one
    ``torch._foreach_*`` call per operation (the offloaded tiers' host step before issue 28, a
    window of groups at a time). The same operations in the same order as the per-tensor
    oracle ``tests.support.adamw.adamw_``: on CPU, bit for bit equal to it
    (tests/torch_impl/test_host_step.py)."""
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
