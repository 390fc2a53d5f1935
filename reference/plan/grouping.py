"""Expert-aware optimizer parameter groups with a hard size cap.

``plan_groups`` turns parameter specs into an ordered tuple of ``GroupPlan``s that every
rank computes identically (the order depends on the specs, never on their input order).
A group never mixes dense and expert params, moe groups (EDP groups), EP ranks or user
groups; with ``split_by_expert`` it holds one layer's one expert, with ``split_dense_by_layer``
a dense group holds one block's params (``dense_block``: ``layers.3``, ``embed``, ...), so a
ZeRO-3 gather unit gathers its own block's params rather than every dense param at once. Each logical group is then
cut into chunks of at most ``max_group_size`` elements, slicing parameters by element range
where a chunk fills up, so the cap is a hard bound (docs/grouping.md, "Grouping").

Frozen parameters (``ParamSpec.frozen``) are grouped by the same rules into *frozen groups*,
named ``frozen/<name>`` and placed after every trained group, so the trained groups' names and
indices are those of the same model with the frozen parameters left out. A frozen group is
partitioned, gathered, offloaded and checkpointed (weights only) like the others but belongs
to no optimizer group: it is never stepped (docs/grouping.md, "Frozen parameters").

Torch counterpart: ``moezero.model.specs`` builds the specs from a module, then
``moezero.zero.groups`` builds torch param groups from this plan.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from moezero.plan.model_buffers import is_buffer
from moezero.plan.rules import check_ep_size, ep_size_problem
from moezero.plan.specs import ParamSpec, Slice, UserGroup, natural_key, user_groups_by_name


@dataclass(frozen=True)
class GroupPlan:
    """One optimizer parameter group: a chunk of one logical group.

    Attributes:
        name: Unique, stable, readable name (see module docs / docs/grouping.md).
        index: Position in the plan.
        user_group: Name of the user group whose hyperparameters apply.
        moe_group: Expert group name, or ``None`` for a dense group.
        ep_size: Expert-parallel size of the moe group (1 for dense).
        ep_rank: EP rank that holds every member (0 for dense): the group lives on the
            ranks ``r`` with ``r % ep_size == ep_rank`` (its EDP group).
        layer: MoE layer FQN when split by expert; a dense group's block when split by layer
            (``dense_block``); else ``None``.
        expert: Global expert index when split by expert, else ``None``.
        members: Element ranges of params, in order; consecutive chunks continue a param.
        frozen: A frozen group: weights only, never stepped (after every trained group).
    """

    name: str
    index: int
    user_group: str
    moe_group: str | None
    ep_size: int
    ep_rank: int
    layer: str | None
    expert: int | None
    members: tuple[Slice, ...]
    frozen: bool = False

    @property
    def numel(self) -> int:
        """Total number of elements over the members."""
        return sum(m.numel for m in self.members)

    @property
    def is_expert(self) -> bool:
        """True for groups of expert params."""
        return self.moe_group is not None


class _Key(NamedTuple):
    """Identity of a logical (unchunked) group."""

    user_group: str
    moe_group: str | None = None
    ep_size: int = 1
    ep_rank: int = 0
    layer: str | None = None
    expert: int | None = None
    frozen: bool = False

    def order(self) -> tuple:
        """Trained before frozen; in each, dense first by (block when split by layer, user
        group); then (moe group, layer, expert, EP rank, user group)."""
        if self.moe_group is None:
            block = () if self.layer is None else (natural_key(self.layer),)
            return (self.frozen, 0, *block, natural_key(self.user_group))
        layer = natural_key(self.layer) if self.layer is not None else ()
        expert = -1 if self.expert is None else self.expert
        return (self.frozen, 1, natural_key(self.moe_group), layer, expert, self.ep_rank,
                natural_key(self.user_group))

    def name(self, chunk: int) -> str:
        name = self._name(chunk)
        return f"frozen/{name}" if self.frozen else name

    def _name(self, chunk: int) -> str:
        if self.moe_group is None:
            block = "" if self.layer is None else f"{self.layer}/"
            return f"dense/{block}{self.user_group}/{chunk}"
        if self.layer is None:
            return f"moe/{self.moe_group}/ep{self.ep_rank}/{self.user_group}/{chunk}"
        return f"moe/{self.moe_group}/{self.layer}/expert{self.expert}/{self.user_group}/{chunk}"


def expert_ep_rank(expert: int, *, num_experts: int, ep_size: int) -> int:
    """EP rank holding global expert ``expert``: ``expert // (num_experts / ep_size)``."""
    check_ep_size(ep_size=ep_size, num_experts=num_experts)
    if not 0 <= expert < num_experts:
        raise ValueError(f"expert {expert} is out of range for {num_experts} experts")
    return expert // (num_experts // ep_size)


def plan_groups(specs: Sequence[ParamSpec], *, max_group_size: int | None = None,
                split_by_expert: bool = True,
                split_dense_by_layer: bool = False) -> tuple[GroupPlan, ...]:
    """Plan the optimizer groups of a model.

    Args:
        specs: Every parameter of the model (all experts, by global index), in any order.
        max_group_size: Hard cap on elements per group; ``None`` means no cap.
        split_by_expert: One logical group per (moe group, layer, expert, user group) if
            True; else one per (moe group, EP rank, user group) across layers and experts.
        split_dense_by_layer: One dense logical group per (block, user group) if True
            (``dense_block``); else one per user group.

    Returns:
        The groups in plan order, indexed from 0, none empty, names unique.

    Raises:
        ValueError: On duplicate FQNs, empty params, inconsistent moe groups or layers,
            expert sets that are not ``0..E-1`` divisible by ``ep_size``, or a bad cap.
    """
    num_experts = _validate(specs, max_group_size)
    buckets: dict[_Key, list[ParamSpec]] = defaultdict(list)
    for spec in specs:
        buckets[_key(spec, num_experts, split_by_expert, split_dense_by_layer)].append(spec)
    groups: list[GroupPlan] = []
    for key in sorted(buckets, key=_Key.order):
        members = sorted(buckets[key], key=lambda s: natural_key(s.fqn))
        for chunk, slices in enumerate(_chunk(members, max_group_size)):
            groups.append(GroupPlan(key.name(chunk), len(groups), key.user_group, key.moe_group,
                                    key.ep_size, key.ep_rank, key.layer, key.expert, slices,
                                    key.frozen))
    return tuple(groups)


def dense_block(fqn: str) -> str:
    """The block a dense parameter belongs to: its FQN up to the first numeric part
    (``layers.3.attn.wq.weight`` -> ``layers.3``), else its first part (``embed``,
    ``lm_head``, ``norm``)."""
    parts = fqn.split(".")
    numbered = next((i for i, p in enumerate(parts[:-1]) if p.isdigit()), None)
    return ".".join(parts[:numbered + 1]) if numbered is not None else parts[0]


def _key(spec: ParamSpec, num_experts: dict[str, int], split_by_expert: bool,
         split_dense_by_layer: bool = False) -> _Key:
    """The logical group a parameter belongs to."""
    if not spec.is_expert:
        block = dense_block(spec.fqn) if split_dense_by_layer else None
        return _Key(spec.user_group, layer=block, frozen=spec.frozen)
    ep_rank = expert_ep_rank(spec.expert, num_experts=num_experts[spec.layer],
                             ep_size=spec.ep_size)
    if split_by_expert:
        return _Key(spec.user_group, spec.moe_group, spec.ep_size, ep_rank, spec.layer,
                    spec.expert, spec.frozen)
    return _Key(spec.user_group, spec.moe_group, spec.ep_size, ep_rank, frozen=spec.frozen)


def _chunk(members: Sequence[ParamSpec], cap: int | None) -> list[tuple[Slice, ...]]:
    """Cut the concatenated members into consecutive runs of at most ``cap`` elements.

    Packing is greedy: a chunk is filled to exactly ``cap`` before the next starts, so a
    param that does not fit the remaining room continues in the next chunk(s).
    """
    cap = cap if cap is not None else sum(s.numel for s in members)
    chunks: list[tuple[Slice, ...]] = []
    current: list[Slice] = []
    room = cap
    for spec in members:
        start = 0
        while start < spec.numel:
            stop = min(spec.numel, start + room)
            current.append(Slice(spec.fqn, start, stop))
            room -= stop - start
            start = stop
            if room == 0:
                chunks.append(tuple(current))
                current, room = [], cap
    if current:
        chunks.append(tuple(current))
    return chunks


def _validate(specs: Sequence[ParamSpec], max_group_size: int | None) -> dict[str, int]:
    """Check the specs as a whole; return the expert count of every MoE layer."""
    if max_group_size is not None and (
            not isinstance(max_group_size, int) or isinstance(max_group_size, bool)
            or max_group_size < 1):
        raise ValueError(f"max_group_size must be a positive int or None, got {max_group_size!r}")
    seen: set[str] = set()
    for spec in specs:
        if spec.fqn in seen:
            raise ValueError(f"param {spec.fqn!r} appears twice")
        seen.add(spec.fqn)
        if spec.numel == 0:
            raise ValueError(f"param {spec.fqn!r} has no elements (shape {spec.shape})")
        if is_buffer(spec.fqn):  # the expert bias: checkpointed, but in no optimizer group
            raise ValueError(f"param {spec.fqn!r} is a buffer (moezero.plan.model_buffers), never "
                             "optimized")
    return _validate_experts([s for s in specs if s.is_expert])


def _validate_experts(specs: Sequence[ParamSpec]) -> dict[str, int]:
    """Each moe group has one ep size, each layer one moe group and experts ``0..E-1``."""
    ep_of_group: dict[str, tuple[int, str]] = {}
    group_of_layer: dict[str, tuple[str, str]] = {}
    experts: dict[str, set[int]] = defaultdict(set)
    for spec in specs:
        ep, first = ep_of_group.setdefault(spec.moe_group, (spec.ep_size, spec.fqn))
        if ep != spec.ep_size:
            raise ValueError(f"param {spec.fqn!r}: ep_size {spec.ep_size} differs from "
                             f"{ep} of {first!r} in moe group {spec.moe_group!r}")
        group, first = group_of_layer.setdefault(spec.layer, (spec.moe_group, spec.fqn))
        if group != spec.moe_group:
            raise ValueError(f"param {spec.fqn!r}: moe_group {spec.moe_group!r} differs from "
                             f"{group!r} of {first!r} in layer {spec.layer!r}")
        experts[spec.layer].add(spec.expert)
    for layer, found in experts.items():
        ep = ep_of_group[group_of_layer[layer][0]][0]
        if found != set(range(len(found))) or ep_size_problem(ep, num_experts=len(found)):
            raise ValueError(f"layer {layer!r}: experts must be 0..E-1 with E divisible by "
                             f"ep_size {ep}, got {sorted(found)}")
    return {layer: len(found) for layer, found in experts.items()}


def locate_params(groups: Iterable[GroupPlan]) -> dict[str, tuple[tuple[int, Slice], ...]]:
    """Map each FQN to the (group index, slice) pieces that hold it, in element order."""
    pieces: dict[str, list[tuple[int, Slice]]] = defaultdict(list)
    for group in groups:
        for member in group.members:
            pieces[member.fqn].append((group.index, member))
    return {fqn: tuple(sorted(found, key=lambda p: p[1].start)) for fqn, found in pieces.items()}


def trained_groups(groups: Iterable[GroupPlan]) -> tuple[GroupPlan, ...]:
    """The groups an optimizer steps: every group but the frozen ones (plan order)."""
    return tuple(g for g in groups if not g.frozen)


def frozen_params(groups: Iterable[GroupPlan]) -> tuple[str, ...]:
    """The FQNs held by frozen groups, in plan order (each once)."""
    return tuple(dict.fromkeys(m.fqn for g in groups if g.frozen for m in g.members))


def group_hparams(groups: Iterable[GroupPlan],
                  user_groups: Iterable[UserGroup]) -> tuple[dict[str, float], ...]:
    """The hyperparameters of each group, from its user group; unknown names raise."""
    by_name = user_groups_by_name(user_groups)
    out = []
    for group in groups:
        if group.user_group not in by_name:
            raise ValueError(f"group {group.name!r}: unknown user group {group.user_group!r}")
        out.append(by_name[group.user_group].as_dict())
    return tuple(out)
