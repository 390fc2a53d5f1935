"""When a run saves, agreed by every rank once per step: ``checkpoint.every`` steps (the
same on every rank), ``checkpoint.every_minutes`` of wall time (rank 0's clock decides), a
preemption request (any rank's) and an async save that failed (any rank's), all in one
all-reduce of three int32 flags (``agree_step``), the collective the preemption agreement
already paid for. docs/reliability.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moezero.distributed.signals import StopRequest

__all__ = ["SaveClock", "StepAgreement", "agree_step"]


class SaveClock:
    """Rank 0's clock of time-based saves: ``due`` once ``every_minutes`` have passed since
    the last save (or the start); 0 turns it off."""

    def __init__(self, every_minutes: float, clock: Callable[[], float] = time.monotonic):
        self.every_s, self._clock = every_minutes * 60.0, clock
        self._last = clock()

    @property
    def on(self) -> bool:
        return self.every_s > 0

    def due(self) -> bool:
        return self.on and self._clock() - self._last >= self.every_s

    def saved(self) -> None:
        """A save just happened (any kind): the next is due ``every_minutes`` from now."""
        self._last = self._clock()


@dataclass(frozen=True)
class StepAgreement:
    """What every rank does after a step: ``stop`` (save and raise ``Preempted``), ``save``
    (a time-based save), ``save_failed`` (raise the failed async save's error)."""

    stop: bool = False
    save: bool = False
    save_failed: bool = False


def agree_step(*, stop: StopRequest | None, clock: SaveClock, save_failed: bool,
               rank: int, device: torch.device | str = "cpu") -> StepAgreement:
    """This step's agreement (collective at W > 1 when there is a stop request or a save
    clock: every rank calls it once per step). Without either, a failed async save is found
    at the next save or at the end instead."""
    flags = [stop is not None and stop.requested, rank == 0 and clock.due(), save_failed]
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return StepAgreement(*map(bool, flags))
    if stop is None and not clock.on:
        return StepAgreement()  # nothing to agree on; a rank alone must not stop
    tensor = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return StepAgreement(*(bool(v) for v in tensor.tolist()))
