"""The pieces the optimizers are made of: one local group's state (``Slot``), the groups that
share one data-parallel group (``Kind``) and the engine's memory accounting (``MemoryMeter``).
The record a checkpoint receives of one shard, ``StateShard``, lives below both sides in
``moezero.plan.state_shard``.

Used by ``moezero.zero.reduce`` (gradient reduction), ``moezero.zero.gather`` (stage 3) and
``moezero.zero.optimizer`` (the step).
Reference counterpart: ``reference/plan/partition.py``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from moezero.plan.partition import Partition
from moezero.zero.buckets import GroupColumns
from moezero.zero.groups import LocalGroup


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class MemoryMeter:
    """Bytes of the engine's own buffers: persistent ones plus temporaries while alive."""

    def __init__(self) -> None:
        self.persistent = self.current = self.peak = 0
        self._lock = threading.Lock()  # a step behind the forward holds and drops too

    def add_persistent(self, *tensors: torch.Tensor) -> None:
        self.persistent += sum(nbytes(t) for t in tensors)
        self.peak = max(self.peak, self.persistent + self.current)

    def start(self) -> None:
        """Begin measuring one step."""
        self.current, self.peak = 0, self.persistent

    def hold(self, nbytes: int) -> None:
        with self._lock:
            self.current += nbytes
            self.peak = max(self.peak, self.persistent + self.current)

    def drop(self, nbytes: int) -> None:
        with self._lock:
            self.current -= nbytes


@dataclass(eq=False)
class Slot:
    """One local optimizer group: its place in its kind's flat buffer and this rank's state.

    Sharded (stages 1-3): ``grad`` and the fp32 states hold this rank's shard of the group.
    Replicated (stage 0): they hold the whole group, ``grad`` and ``param`` being views of the
    kind's flat gradients and parameters."""

    group: LocalGroup
    offset: int  # element offset of the group in its kind's flat buffer
    dp_rank: int
    columns: GroupColumns  # how the reduction sees the group (``moezero.zero.buckets``)
    master: torch.Tensor | None = None
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None
    grad: torch.Tensor | None = None  # reduced gradient (shard or whole group), compute dtype
    param: torch.Tensor | None = None  # the downcast's target: stage-3 shard or the group's params
    channel: str = ""  # its data-parallel group's name (``Kind.channel``)

    @property
    def partition(self) -> Partition:
        return self.group.partition

    @property
    def numel(self) -> int:
        return self.group.partition.numel

    @property
    def shard(self) -> int:
        return self.group.partition.shard_numel

    def rank_range(self, dp_rank: int) -> tuple[int, int]:
        """The real elements [lo, hi) of DP rank ``dp_rank``'s shard within the group."""
        lo = min(dp_rank * self.shard, self.numel)
        return lo, min(lo + self.shard, self.numel)


@dataclass(eq=False)
class Kind:
    """A flat buffer of groups sharing one data-parallel group (dense, or moe group x EP rank)."""

    name: str
    dp_size: int
    group: object  # process group; None = the world (dense) or no communication (dp_size 1)
    channel: str  # the process group's name, to order collectives
    slots: list[Slot]
    params: torch.Tensor | None = None
    grads: torch.Tensor | None = None  # stage 1: full local grads, viewed by param.grad
    frozen: bool = False  # frozen groups only (``train.freeze``): no gradients, never stepped


def read_members(columns: GroupColumns, lo: int, hi: int, dst: torch.Tensor, tensor_of) -> None:
    """Copy the group elements [lo, hi) of ``tensor_of(fqn)`` (None: skipped) into ``dst``."""
    for fqn, start, at, count in columns.members_in(lo, hi):
        t = tensor_of(fqn)
        if t is not None:
            dst[at:at + count].copy_(t.reshape(-1)[start:start + count])
