"""Where a stage-3 model's params live while gathered: one storage per gather unit where
its groups allow.

A gather unit's groups are gathered and released together. Where no other unit needs them
and their members are whole params (none sliced across groups by ``moe.max_group_size``) of
one dtype and device, they get one storage: the groups in plan order, each param's data a
view at its member's offset. A gather then fills each group with one copy, a release frees
the unit at once, and a MoE layer's local experts (one unit; a group per expert, or one)
sit at one stride, so ``model.experts.stack_weights`` views them instead of copying the
layer's expert weights in every forward and backward: on the ``nvme`` benchmark (0.41 B, W =
2) that stacking and the per-member copies were a third of backward's CPU time. A group
another unit also needs gets a storage of its own, a group with a sliced param a storage per
param, as before. Storages are freed with ``untyped_storage().resize_(0)`` and re-allocated
while used (the params keep their shape, autograd its references); host storages ask for
transparent huge pages before their first touch (``moezero.memory.pinned``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch
from torch import nn

from moezero.memory.pinned import advise_huge_pages
from moezero.zero.shards import Slot


def _kind(params: dict[str, nn.Parameter], slot: Slot) -> tuple:
    """(dtype, device) of the group's first member."""
    first = params[slot.partition.offsets[0][0].fqn]
    return first.dtype, first.device


def _whole(params: dict[str, nn.Parameter], slot: Slot) -> bool:
    """Every member a whole param of the group's dtype and device."""
    kind = _kind(params, slot)
    return all(m.start == 0 and m.stop == params[m.fqn].numel()
               and (params[m.fqn].dtype, params[m.fqn].device) == kind
               for m, _ in slot.partition.offsets)


def _numel(slot: Slot) -> int:
    return max(off + m.numel for m, off in slot.partition.offsets)


def storage_sets(params: dict[str, nn.Parameter], slots: Sequence[Slot],
                 units: Sequence[Sequence[int]]) -> list[list[int]]:
    """The groups that share a storage: each unit's groups, where no other unit needs them
    and their members are whole params of one dtype and device (each unit's groups are
    gathered and released together); a group that fails only the first test alone."""
    owners: dict[str, int] = {}
    for i, slot in enumerate(slots):
        for member, _ in slot.partition.offsets:
            owners[member.fqn] = -1 if member.fqn in owners else i
    flat = {i for i, slot in enumerate(slots) if _whole(params, slot)
            and all(owners[m.fqn] == i for m, _ in slot.partition.offsets)}
    needed = Counter(i for unit in units for i in unit)
    sets = []
    for unit in units:
        own = [i for i in unit if i in flat and needed[i] == 1]
        if len({_kind(params, slots[i]) for i in own}) == 1:
            sets.append(own)
        else:
            sets += [[i] for i in own]
    shared = {i for unit_set in sets for i in unit_set}
    return sets + [[i] for i in sorted(flat - shared)]


class GroupStorage:
    """The storages of a stage-3 model's params by group (see the module doc); frees them all
    at construction.

    Args:
        params: The params by FQN.
        slots: The optimizer's slots (each group's members and partition), in plan order.
        units: Each gather unit's slot indices.
    """

    def __init__(self, params: dict[str, nn.Parameter], slots: Sequence[Slot],
                 units: Sequence[Sequence[int]]):
        self.params, self.slots = params, slots
        self.size: dict[int, int] = {}  # group -> elements of the storage it shares
        self.numel: dict[int, int] = {}  # group -> its own elements (of a shared storage)
        for groups in storage_sets(params, slots, units):
            self._rehome([slots[i] for i in groups])
            total = sum(_numel(slots[i]) for i in groups)
            self.size.update(dict.fromkeys(groups, total))
            self.numel.update({i: _numel(slots[i]) for i in groups})
        for p in params.values():
            p.data.untyped_storage().resize_(0)

    def _rehome(self, groups: list[Slot]) -> None:
        """Make the groups' members views of one (freed) storage, the groups in turn, each
        member at its offset in its group."""
        first = self.params[groups[0].partition.offsets[0][0].fqn]
        flat = torch.empty(sum(_numel(s) for s in groups), dtype=first.dtype, device=first.device)
        cursor = 0
        for slot in groups:
            for member, offset in slot.partition.offsets:
                p = self.params[member.fqn]
                p.data = flat.as_strided(p.shape, p.stride(), cursor + offset)
            cursor += _numel(slot)
        flat.untyped_storage().resize_(0)  # one unit at a time

    def allocate(self, i: int) -> None:
        """Re-allocate group ``i``'s storage(s) (uninitialised)."""
        for member, _ in self.slots[i].partition.offsets:
            p = self.params[member.fqn]
            storage = p.data.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(self.size.get(i, p.numel()) * p.element_size())
                if p.device.type == "cpu":
                    advise_huge_pages(storage.data_ptr(), storage.nbytes())

    def release(self, i: int) -> None:
        """Free group ``i``'s storage(s) (a shared one: every group sharing it is released
        in the same call of the gatherer)."""
        for member, _ in self.slots[i].partition.offsets:
            storage = self.params[member.fqn].data.untyped_storage()
            if storage.nbytes():
                storage.resize_(0)

    def write(self, i: int, lo: int, hi: int, values: torch.Tensor) -> None:
        """Group ``i``'s elements [lo, hi) into its storage (one copy where it shares one)."""
        columns = self.slots[i].columns
        if i in self.numel:
            first = self.params[columns.partition.offsets[0][0].fqn].data
            flat = first.as_strided((self.numel[i],), (1,), first.storage_offset())
            stop = min(hi, self.numel[i])
            if lo < stop:
                flat[lo:stop].copy_(values[:stop - lo])
            return
        for fqn, start, at, count in columns.members_in(lo, hi):
            self.params[fqn].data.view(-1)[start:start + count].copy_(values[at:at + count])
