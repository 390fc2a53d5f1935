"""ZeRO partitions of the optimizer groups over their data-parallel ranks, and the topology.

Each group is laid out as one flat buffer (members contiguous, in group order, no gaps),
padded to a multiple of ``dp_size * align`` and split evenly: DP rank ``d`` owns
``[d * shard_numel, (d + 1) * shard_numel)``. A dense group is sharded over all W ranks;
an expert group over its EDP group (the W / ep ranks ``r`` with ``r % ep == ep_rank``),
where rank ``r`` is DP rank ``r // ep`` (docs/grouping.md, "Partitioning").

Topology: EP groups are consecutive blocks of ``ep`` ranks; EDP groups are the ranks
with the same ``rank % ep``. Torch counterpart: ``moezero.distributed.topology`` (process groups)
and ``moezero.zero.sharded`` (flat buffers built from these partitions).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from moezero.plan.grouping import GroupPlan
from moezero.plan.rules import check_ep_size
from moezero.plan.specs import Slice


def ep_rank(rank: int, *, ep_size: int) -> int:
    """Index of ``rank`` inside its EP group, i.e. which block of experts it holds."""
    _check_rank(rank, ep_size)
    return rank % ep_size


def edp_rank(rank: int, *, ep_size: int) -> int:
    """Index of ``rank`` inside its EDP group: its data-parallel rank for expert params."""
    _check_rank(rank, ep_size)
    return rank // ep_size


def ep_group_ranks(rank: int, *, world_size: int, ep_size: int) -> tuple[int, ...]:
    """The EP group of ``rank``: the consecutive block of ``ep_size`` ranks containing it."""
    check_ep_size(world_size=world_size, ep_size=ep_size)
    _check_rank(rank, ep_size, world_size)
    start = rank - rank % ep_size
    return tuple(range(start, start + ep_size))


def edp_group_ranks(rank: int, *, world_size: int, ep_size: int) -> tuple[int, ...]:
    """The EDP group of ``rank``: all ranks holding the same experts, in DP-rank order."""
    check_ep_size(world_size=world_size, ep_size=ep_size)
    _check_rank(rank, ep_size, world_size)
    return tuple(range(rank % ep_size, world_size, ep_size))


def _check_rank(rank: int, ep_size: int, world_size: int | None = None) -> None:
    check_ep_size(ep_size=ep_size)
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    if world_size is not None and rank >= world_size:
        raise ValueError(f"rank {rank} is out of range for world_size {world_size}")


@dataclass(frozen=True)
class Partition:
    """How one group's flat buffer is padded and split over its DP ranks.

    Attributes:
        group: The group's name.
        dp_size: Ranks sharing the group: W for dense groups, W // ep_size for experts.
        align: Alignment in elements; every shard is a multiple of it.
        numel: Unpadded elements (the group's numel).
        padded_numel: ``numel`` rounded up to a multiple of ``dp_size * align``.
        shard_numel: ``padded_numel // dp_size``, the elements each DP rank owns.
        offsets: Each member slice with its element offset in the flat buffer.
        ep_size: The group's expert-parallel size (1 for dense).
        ep_rank: The EP rank holding the group (0 for dense).
    """

    group: str
    dp_size: int
    align: int
    numel: int
    padded_numel: int
    shard_numel: int
    offsets: tuple[tuple[Slice, int], ...]
    ep_size: int = 1
    ep_rank: int = 0

    @property
    def ranks(self) -> tuple[int, ...]:
        """Global ranks holding the group, indexed by DP rank."""
        return tuple(range(self.ep_rank, self.dp_size * self.ep_size, self.ep_size))

    def dp_rank(self, rank: int) -> int:
        """DP rank of global ``rank`` in this group; ValueError if it does not hold it."""
        if not 0 <= rank < self.dp_size * self.ep_size or rank % self.ep_size != self.ep_rank:
            raise ValueError(f"group {self.group!r}: rank {rank} does not hold it")
        return rank // self.ep_size

    def rank_range(self, dp_rank: int) -> tuple[int, int]:
        """``[start, stop)`` of DP rank ``dp_rank``'s shard in the flat buffer."""
        if not 0 <= dp_rank < self.dp_size:
            raise ValueError(f"group {self.group!r}: dp_rank {dp_rank} not in [0, {self.dp_size})")
        return dp_rank * self.shard_numel, (dp_rank + 1) * self.shard_numel

    def rank_slices(self, dp_rank: int) -> tuple[tuple[Slice, int], ...]:
        """Member element ranges inside ``dp_rank``'s shard, each with its offset in the shard.

        Members are clipped to the shard; padding is not reported.
        """
        lo, hi = self.rank_range(dp_rank)
        out = []
        for member, offset in self.offsets:
            start, stop = max(lo, offset), min(hi, offset + member.numel)
            if start < stop:
                piece = Slice(member.fqn, member.start + start - offset, member.start + stop - offset)
                out.append((piece, start - lo))
        return tuple(out)


def partition_group(group: GroupPlan, *, world_size: int, align: int = 1) -> Partition:
    """Lay out and split one group over its DP ranks (see ``plan_partitions``)."""
    check_ep_size(world_size=world_size, ep_size=group.ep_size)
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    dp_size = world_size // group.ep_size
    offsets, cursor = [], 0
    for member in group.members:
        offsets.append((member, cursor))
        cursor += member.numel
    unit = dp_size * align
    padded = -(-cursor // unit) * unit
    return Partition(group.name, dp_size, align, cursor, padded, padded // dp_size,
                     tuple(offsets), group.ep_size, group.ep_rank)


def plan_partitions(groups: Iterable[GroupPlan], *, world_size: int,
                    align: int = 1) -> tuple[Partition, ...]:
    """Partition every group, in plan order.

    Args:
        groups: The plan from ``plan_groups``.
        world_size: W, the number of ranks.
        align: Elements each shard is a multiple of (e.g. 16 bytes / itemsize for I/O).

    Raises:
        ValueError: If a group's ``ep_size`` does not divide ``world_size`` or align < 1.
    """
    return tuple(partition_group(g, world_size=world_size, align=align) for g in groups)
