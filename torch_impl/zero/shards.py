"""The pieces a ZeRO optimizer is made of: one local group's shard (``Slot``), the groups that
share one data-parallel group (``Kind``) and the engine's memory accounting (``MemoryMeter``).

Used by ``moezero.zero.reduce`` (gradient reduction), ``moezero.zero.gather`` (stage 3) and
``moezero.zero.sharded`` (the step). Reference counterpart: ``reference/plan/partition.py``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from moezero.zero.groups import LocalGroup


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class MemoryMeter:
    """Bytes of the engine's own buffers: persistent ones plus temporaries while alive."""

    def __init__(self) -> None:
        self.persistent = self.current = self.peak = 0

    def add_persistent(self, *tensors: torch.Tensor) -> None:
        self.persistent += sum(nbytes(t) for t in tensors)
        self.peak = max(self.peak, self.persistent + self.current)

    def start(self) -> None:
        """Begin measuring one step."""
        self.current, self.peak = 0, self.persistent

    def hold(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.persistent + self.current)

    def drop(self, nbytes: int) -> None:
        self.current -= nbytes


@dataclass(eq=False)
class Slot:
    """One local optimizer group: its place in its kind's flat buffer and this rank's shard."""

    group: LocalGroup
    offset: int  # element offset of the group in its kind's flat buffer
    dp_rank: int
    starts: list[int] = field(default_factory=list)  # member offsets (for bisect)
    master: torch.Tensor | None = None
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None
    grad: torch.Tensor | None = None  # reduced grad partition, compute dtype
    param: torch.Tensor | None = None  # stage 3: the param shard, compute dtype
    channel: str = ""  # its data-parallel group's name (``Kind.channel``)

    @property
    def numel(self) -> int:
        return self.group.partition.numel

    @property
    def shard(self) -> int:
        return self.group.partition.shard_numel

    def rows(self, a: int, b: int):
        """(row d, lo, hi): the group elements of columns [a, b) in DP rank d's shard."""
        for d in range(self.group.partition.dp_size):
            lo, hi = d * self.shard + a, min(d * self.shard + b, self.numel)
            if lo < hi:
                yield d, lo, hi

    def members_in(self, lo: int, hi: int):
        """(fqn, param element start, start in [lo, hi), count) of members overlapping it."""
        offsets = self.group.partition.offsets
        i = max(bisect.bisect_right(self.starts, lo) - 1, 0)
        while i < len(offsets) and offsets[i][1] < hi:
            member, off = offsets[i]
            start, stop = max(lo, off), min(hi, off + member.numel)
            if start < stop:
                yield member.fqn, member.start + start - off, start - lo, stop - start
            i += 1


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
