"""Topology: the DP, EP and EDP process groups, built and validated in one place.

World size W = DP. A MoE layer's expert-parallel size ``ep`` divides W and its expert count.
EP groups are consecutive blocks of ``ep`` ranks; expert-data-parallel (EDP) groups are the
ranks holding the same experts (same ``rank % ep``), of size W/ep. Expert ``e`` lives on EP
rank ``e // (E/ep)``. Everything that needs a group takes this object explicitly; only the
launcher and the CLI read environment variables. Reference counterpart: ``reference/plan/partition.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

import moezero.plan.partition as plan
from moezero.plan import rules


@dataclass(frozen=True)
class Topology:
    """Process groups of one run. ``ep_groups``/``edp_groups`` map ep size -> this rank's group.

    With W == 1 (or no process group initialised) every group is ``None`` and collectives are
    skipped by callers via :meth:`distributed`.
    """

    rank: int
    world_size: int
    ep_sizes: tuple[int, ...]
    ep_groups: dict[int, object] = field(default_factory=dict, compare=False, repr=False)
    edp_groups: dict[int, object] = field(default_factory=dict, compare=False, repr=False)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def ep_rank(self, ep: int) -> int:
        """This rank's index inside its EP group (which block of experts it holds)."""
        return plan.ep_rank(self.rank, ep_size=ep)

    def edp_rank(self, ep: int) -> int:
        """This rank's index inside its EDP group (its data-parallel rank for experts)."""
        return plan.edp_rank(self.rank, ep_size=ep)

    def ep_group(self, ep: int):
        return self.ep_groups.get(ep)

    def edp_group(self, ep: int):
        return self.edp_groups.get(ep)


def validate(world_size: int, ep: int, num_experts: int) -> None:
    """Raise ValueError (one line, ``moe.ep_size: …``) unless ``ep`` divides both W and the
    expert count (the plan's ``ep_size_problem``)."""
    problem = rules.ep_size_problem(ep, world_size=world_size, num_experts=num_experts)
    if problem is not None:
        raise ValueError(f"moe.ep_size: {problem}")


def build_topology(ep_sizes: tuple[int, ...] | list[int], *, num_experts: int) -> Topology:
    """Create the EP/EDP groups for every ep size used by the model (collective: call on all ranks).

    ``new_group`` must be called by every rank for every group, in the same order.
    """
    initialised = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if initialised else 0
    world = dist.get_world_size() if initialised else 1
    ep_sizes = tuple(sorted(set(ep_sizes)))
    for ep in ep_sizes:
        validate(world, ep, num_experts)
    ep_groups, edp_groups = {}, {}
    if world > 1:
        for ep in ep_sizes:
            # every rank creates every group, in the same order (new_group is collective)
            for ranks_of, groups in ((plan.ep_group_ranks, ep_groups),
                                     (plan.edp_group_ranks, edp_groups)):
                for ranks in sorted({ranks_of(r, world_size=world, ep_size=ep)
                                     for r in range(world)}):
                    group = dist.new_group(list(ranks))
                    if rank in ranks:
                        groups[ep] = group
    return Topology(rank, world, ep_sizes, ep_groups, edp_groups)


def gather_groups(topology: Topology) -> dict[str, object]:
    """Second copies of the world and EDP groups, for ZeRO-3's parameter all-gathers.

    Keyed like ``shards.Kind.channel`` (``world``, ``edp<ep>``). Collectives on one group must
    be issued in the same order on every rank; gathers follow the modules' order and gradient
    reduce-scatters follow the gradients' arrival, so each gets its own groups. Collective:
    call on every rank (``new_group`` for every group, in the same order).
    """
    groups: dict[str, object] = {"world": None}
    if not topology.distributed:
        return groups | {f"edp{ep}": None for ep in topology.ep_sizes}
    groups["world"] = dist.new_group(list(range(topology.world_size)))
    for ep in topology.ep_sizes:
        for ranks in sorted({plan.edp_group_ranks(r, world_size=topology.world_size, ep_size=ep)
                             for r in range(topology.world_size)}):
            group = dist.new_group(list(ranks))
            if topology.rank in ranks:
                groups[f"edp{ep}"] = group
    return groups
