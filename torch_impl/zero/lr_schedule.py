"""DeepSpeed's lr schedules (``optimizer.scheduler``, ``moezero.config.schedule``), so an
imported DeepSpeed run continues at the lr DeepSpeed would have used.

DeepSpeed's scheduler counts iterations from -1 (set at construction) and steps after every
applied optimizer step, so the optimizer step after ``step`` applied ones runs at iteration
``step - 1``: the first two steps both run at the warmup's start. moezero's ``step`` is the
engine's ``step_count`` (Adam's step, skipped steps excluded, as DeepSpeed's scheduler skips
them too). Written from DeepSpeed's documented definitions (``deepspeed.runtime.lr_schedules``).
"""

from __future__ import annotations

import math

from moezero.config.schedule import LRScheduleConfig


def scheduled_lr(schedule: LRScheduleConfig, step: int, *, peak: float) -> float:
    """The lr of the optimizer step after ``step`` applied ones; ``peak``: ``optimizer.lr``."""
    i = step - 1
    if schedule.type == "WarmupCosineLR":
        return peak * _cosine_ratio(schedule, i)
    low = schedule.warmup_min_lr
    return low + (peak - low) * _gamma(schedule, i)


def _warmup_steps(schedule: LRScheduleConfig) -> int:
    return max(2, schedule.warmup_num_steps)


def _warm(schedule: LRScheduleConfig, i: int) -> float:
    """The warmup's fraction at iteration ``0 <= i < warmup_num_steps``."""
    n = _warmup_steps(schedule)
    if schedule.warmup_type == "log":
        return math.log(i + 1) / math.log(n)
    return i / n


def _gamma(schedule: LRScheduleConfig, i: int) -> float:
    """WarmupLR / WarmupDecayLR: the fraction of the way from warmup_min_lr to the peak."""
    n = _warmup_steps(schedule)
    if i < 0:
        return 0.0
    if i < n:
        return _warm(schedule, i)
    if schedule.type == "WarmupLR":
        return 1.0
    total = schedule.total_num_steps
    return max(0.0, (total - i) / max(1, total - n))


def _cosine_ratio(schedule: LRScheduleConfig, i: int) -> float:
    """WarmupCosineLR: the lr over the peak (0 before the first iteration)."""
    n = _warmup_steps(schedule)
    if i < 0:
        return 0.0
    if i < n:
        low = schedule.warmup_min_ratio
        return low + _warm(schedule, i) * (1.0 - low)
    progress = min(1.0, (i - n + 1) / max(1, schedule.total_num_steps - n))
    floor = schedule.cos_min_ratio
    return max(0.0, floor + (1.0 - floor) * (1.0 + math.cos(math.pi * progress)) / 2)
