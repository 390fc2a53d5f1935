"""Where each element of a DeepSpeed parameter lies in the per-rank optimizer files (pure).

Rank r's state of one kind (master, exp_avg, exp_avg_sq) is taken as one vector: its
partitions of every group, concatenated in group order (``Placement.rank_numel``).

- Stages 1/2: each group's params are flattened in order with no gaps, padded at the end to a
  multiple of ``2 * W`` (DeepSpeed's ``nccl_start_alignment_factor``) and split evenly: flat
  element j of group g is on rank ``j // P_g`` at ``j % P_g``, ``P_g = padded / W``.
- Stage 3: every param is split on its own: ``p = ceil(numel / W)`` elements per rank, the last
  rank's tail padded; each rank holds its pieces of the params back to back.

Legend: ``a, b`` element range of one param, ``p`` per-rank elements of one param (stage 3),
``P`` per-rank elements of one group (stages 1/2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

ALIGN = 2  # DeepSpeed's nccl_start_alignment_factor (stages 1/2)


class Piece(NamedTuple):
    """``length`` elements at ``offset`` of rank ``rank``'s vector hold the elements
    ``[start, start + length)`` of the requested range (counted from its first element)."""

    rank: int
    offset: int
    start: int
    length: int


@dataclass(frozen=True)
class Placement:
    """Per param: (group's base offset in a rank's vector, param's offset in the group or
    (stage 3) in the rank's vector, numel); per rank: its vector's length."""

    stage: int
    world_size: int
    params: dict[str, tuple[int, int, int]]
    group_numel: tuple[int, ...]  # per-rank elements of each group (P_g; stage 3: its sum)
    rank_numel: int

    def pieces(self, name: str, a: int, b: int) -> list[Piece]:
        """The pieces of elements ``[a, b)`` of param ``name``, in element order."""
        base, offset, numel = self.params[name]
        if not 0 <= a <= b <= numel:
            raise ValueError(f"{name}: range [{a}, {b}) outside its {numel} elements")
        if self.stage == 3:
            per = -(-numel // self.world_size)
            return _split(a, b, per, lambda i: offset + i)
        per = self.group_numel[self._group(base)]
        return _split(offset + a, offset + b, per, lambda i: base + i)

    def _group(self, base: int) -> int:
        acc = 0
        for g, numel in enumerate(self.group_numel):
            if acc == base:
                return g
            acc += numel
        raise ValueError(f"no group starts at {base}")


def _split(a: int, b: int, per: int, where) -> list[Piece]:
    """Cut ``[a, b)`` at multiples of ``per``; ``where(index in the rank's part)`` -> offset."""
    out, i = [], a
    while i < b:
        rank, local = divmod(i, per)
        stop = min(b, (rank + 1) * per)
        out.append(Piece(rank, where(local), i - a, stop - i))
        i = stop
    return out


def plan(stage: int, world_size: int, groups) -> Placement:
    """The placement of ``groups`` (per group, ``(name, shape)`` in flattening order)."""
    params: dict[str, tuple[int, int, int]] = {}
    if stage == 3:
        offset = 0
        for group in groups:
            for name, shape in group:
                numel = math.prod(shape)
                params[name] = (0, offset, numel)
                offset += -(-numel // world_size)
        return Placement(stage, world_size, params, (offset,), offset)
    sizes, base = [], 0
    for group in groups:
        offset = 0
        for name, shape in group:
            params[name] = (base, offset, math.prod(shape))
            offset += math.prod(shape)
        unit = ALIGN * world_size
        per = -(-offset // unit) * unit // world_size
        sizes.append(per)
        base += per
    return Placement(stage, world_size, params, tuple(sizes), base)
