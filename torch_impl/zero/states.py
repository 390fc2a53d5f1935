"""Where the fp32 optimizer state of the trained groups lives: tensors on the slots (device or
host memory), or the optimizer tier's swap files (``offload.state.SwapState``), read into host
buffers. ``OptimizerStates`` hands each group's ``{"master", "exp_avg", "exp_avg_sq"}`` to the
step (written back), to checkpoints and exports (read only), and names the swap files a
checkpoint copies. It knows nothing of the step running behind the forward: its callers
finish that first (``zero.optimizer.Optimizer.finish_step``). Reference counterpart: the
optax state of ``reference/optim.py``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from moezero.plan.layout import STATES
from moezero.plan.state_shard import StateShard
from moezero.zero.shards import Slot

__all__ = ["OptimizerStates"]

States = dict[str, torch.Tensor]


class OptimizerStates:
    """The fp32 states of ``slots`` (the trained groups, plan order), in memory or in ``swap``.

    Args:
        slots: The trained groups' slots, in plan order (the optimizer's list itself).
        swap: The optimizer tier's swap files (``load``, ``drop``, ``stepping``, ``path``), or
            None: the states are the slots' ``master``, ``exp_avg``, ``exp_avg_sq``.
    """

    def __init__(self, slots: list[Slot], swap=None) -> None:
        self.slots, self.swap = slots, swap

    def stepping(self) -> Iterator[tuple[Slot, States]]:
        """(slot, states) in plan order: the tensors themselves, or swap files' contents in
        host buffers that are written back once the consumer moves on."""
        if self.swap is not None:
            for slot, (bufs,) in zip(self.slots, self.swap.stepping([[s] for s in self.slots]),
                                     strict=True):
                yield slot, bufs
            return
        for slot in self.slots:
            yield slot, _in_memory(slot)

    def windows(self, windows: Sequence[Sequence[Slot]],
                **hooks) -> Iterator[list[tuple[Slot, States]]]:
        """Each window's (slot, states) pairs: the tensors, or swap files' contents in host
        buffers (read a window ahead, written back a window behind; ``hooks``:
        ``SwapState.stepping``'s)."""
        if self.swap is not None:
            for window, bufs in zip(windows, self.swap.stepping(windows, **hooks), strict=True):
                yield list(zip(window, bufs, strict=True))
            return
        for window in windows:
            yield [(slot, _in_memory(slot)) for slot in window]

    def read(self) -> Iterator[tuple[Slot, States]]:
        """Like ``stepping``, but swapped states are read into host buffers and not written
        back."""
        if self.swap is None:
            yield from self.stepping()
            return
        for slot in self.slots:
            bufs = self.swap.load(slot)
            yield slot, bufs
            self.swap.drop(bufs)

    def swapped_shards(self) -> list[StateShard]:
        """This rank's range of every group as its swap files (which hold that range)."""
        return [StateShard(slot.partition, slot.dp_rank,
                           files={s: self.swap.path(slot, s) for s in STATES})
                for slot in self.slots]


def _in_memory(slot: Slot) -> States:
    return {"master": slot.master, "exp_avg": slot.exp_avg, "exp_avg_sq": slot.exp_avg_sq}
