"""The ``hoststep`` series' tensors and timing loop, shared by this venv and the peer venv.

Imports torch only (the peer venv has no moezero): ``state(numel)`` gives the same fp32
param, gradient and moments in both processes (seeded), ``best_ms`` times a callable the same
way in both (best of ``repeats`` after one warm-up call, one thread; CPU and wall time).
"""

from __future__ import annotations

import time

import torch

HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
BYTES_PER_ELEMENT = 28  # fp32: read param, grad, exp_avg, exp_avg_sq; write param and moments


def state(numel: int) -> list[torch.Tensor]:
    """param, grad, exp_avg, exp_avg_sq: fp32, ``numel`` each, seeded (every page touched)."""
    gen = torch.Generator().manual_seed(0)
    p, g, m = (torch.randn(numel, generator=gen) for _ in range(3))
    return [p, g, m.mul_(0.1), torch.rand(numel, generator=gen).mul_(0.01)]


def best_ms(fn, repeats: int) -> dict[str, float]:
    """Best CPU time (``cpu``: the process's, so time spent descheduled by other load is left
    out) and best wall time (``wall``) of ``fn()`` in ms over ``repeats`` calls, after one
    untimed call."""
    fn()
    cpu, wall = [], []
    for _ in range(repeats):
        start_cpu, start = time.process_time(), time.perf_counter()
        fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return {"cpu": 1e3 * min(cpu), "wall": 1e3 * min(wall)}
