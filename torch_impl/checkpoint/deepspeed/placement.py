"""Where each element of a DeepSpeed parameter lies in the per-rank optimizer files (pure).

Rank r's state of one kind (master, exp_avg, exp_avg_sq) is taken as one vector: its
partitions of every group, concatenated in group order.

- Stages 1/2: a group's params are flattened in order with no gaps, padded at the end to a
  multiple of ``2 * n`` (DeepSpeed's ``nccl_start_alignment_factor``) and split evenly over the
  ``n`` ranks that share it: flat element j is on the group's ``j // P``-th rank at ``j % P``.
  A dense group is shared by all W ranks; a native-MoE expert group (``ep`` set) exists once
  per expert-parallel rank k, holding that rank's experts (global index ``k * local + i`` for
  local index i), shared by its expert-data-parallel ranks ``k, k + ep, k + 2 ep, ...``.
- Stage 0 (no ZeRO): every group whole, unpadded; a dense group read from the first file, the
  expert group of expert-parallel rank k from file k (``unsharded``).
- Stage 3: every param is split on its own: ``p = ceil(numel / W)`` elements per rank, the last
  rank's tail padded; each rank holds its pieces of the params back to back.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import NamedTuple

ALIGN = 2  # DeepSpeed's nccl_start_alignment_factor (stages 1/2)
_LOCAL_EXPERT = re.compile(r"(\.deepspeed_experts\.)(\d+)(\.)")


class Piece(NamedTuple):
    """``length`` elements at ``offset`` of rank ``rank``'s vector hold the elements
    ``[start, start + length)`` of the requested range (counted from its first element)."""

    rank: int
    offset: int
    start: int
    length: int


class Flat(NamedTuple):
    """One flattened group: its offset in each holder's vector, elements per holder, holders."""

    base: int
    per: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Placement:
    """Per param: (flat index, offset in the flat or (stage 3) in the rank's vector, numel)."""

    stage: int
    world_size: int
    params: dict[str, tuple[int, int, int]]
    flats: tuple[Flat, ...]
    group_numel: tuple[int, ...]  # each group's per-rank elements (stage 3: their sum)
    shapes: dict[str, tuple[int, ...]]  # every param under its global name

    def pieces(self, name: str, a: int, b: int) -> list[Piece]:
        """The pieces of elements ``[a, b)`` of param ``name``, in element order."""
        flat, offset, numel = self.params[name]
        if not 0 <= a <= b <= numel:
            raise ValueError(f"{name}: range [{a}, {b}) outside its {numel} elements")
        if self.stage == 3:
            per = -(-numel // self.world_size)
            return _split(a, b, per, range(self.world_size), lambda i: offset + i)
        f = self.flats[flat]
        return _split(offset + a, offset + b, f.per, f.ranks, lambda i: f.base + i)


def _split(a: int, b: int, per: int, ranks, where) -> list[Piece]:
    """Cut ``[a, b)`` at multiples of ``per``; ``where(index in the holder's part)`` -> offset."""
    out, i = [], a
    while i < b:
        k, local = divmod(i, per)
        stop = min(b, (k + 1) * per)
        out.append(Piece(ranks[k], where(local), i - a, stop - i))
        i = stop
    return out


def global_expert_name(name: str, ep_rank: int, num_local: int) -> str:
    """A native-MoE param's name with its local expert index made global."""
    return _LOCAL_EXPERT.sub(lambda m: f"{m[1]}{ep_rank * num_local + int(m[2])}{m[3]}", name)


def num_local_experts(group) -> int:
    """Experts per expert-parallel rank in one group (local indices 0..n-1)."""
    found = {int(m[2]) for name, _ in group for m in [_LOCAL_EXPERT.search(name)] if m}
    return max(found) + 1 if found else 0


def plan(stage: int, world_size: int, groups, eps: tuple[int | None, ...] | None = None
         ) -> Placement:
    """The placement of ``groups`` (per group, ``(name, shape)`` in flattening order, as rank 0
    names them); ``eps[g]``: the expert-parallel size of a native-MoE group, None if dense."""
    params: dict[str, tuple[int, int, int]] = {}
    if stage == 3:
        offset = 0
        for group in groups:
            for name, shape in group:
                params[name] = (0, offset, math.prod(shape))
                offset += -(-math.prod(shape) // world_size)
        shapes = {name: tuple(shape) for group in groups for name, shape in group}
        return Placement(stage, world_size, params, (Flat(0, offset, ()),), (offset,), shapes)
    flats, sizes, base, shapes = [], [], 0, {}
    for g, group in enumerate(groups):
        ep = (eps or [None] * len(groups))[g]
        copies = [(range(world_size), group)] if ep is None else [
            (range(k, world_size, ep), _renamed(group, k, num_local_experts(group)))
            for k in range(ep)]
        if stage == 0:  # whole params, no padding: read from expert-parallel rank k's file
            copies = [(range(k, k + 1), members) for k, (_, members) in enumerate(copies)]
        for ranks, members in copies:
            per = _per_rank(members, len(ranks)) if stage else sum(_prod_all(members))
            for offset, (name, shape) in zip(_offsets(members), members, strict=True):
                params[name] = (len(flats), offset, math.prod(shape))
                shapes[name] = tuple(shape)
            flats.append(Flat(base, per, tuple(ranks)))
        sizes.append(per)
        base += per
    return Placement(stage, world_size, params, tuple(flats), tuple(sizes), shapes)


def _renamed(group, ep_rank: int, num_local: int):
    return [(global_expert_name(n, ep_rank, num_local), s) for n, s in group]


def _offsets(members) -> list[int]:
    out, acc = [], 0
    for _, shape in members:
        out.append(acc)
        acc += math.prod(shape)
    return out


def _prod_all(members) -> list[int]:
    return [math.prod(s) for _, s in members]


def _per_rank(members, n: int) -> int:
    total = sum(math.prod(s) for _, s in members)
    unit = ALIGN * n
    return -(-total // unit) * unit // n
