"""``moezero.zero.group_storage`` on hand-made slots: which groups share a storage, and a
padded partition written into a shared one (issue 38: two planted bugs here survived the
stage-3 suites, whose models never hit these cases)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from moezero.zero.group_storage import GroupStorage, storage_sets


def _slot(members: list[tuple[str, int]]) -> SimpleNamespace:
    """A slot whose group holds the whole params ``members`` (name, elements) in order."""
    offsets, at = [], 0
    for fqn, numel in members:
        offsets.append((SimpleNamespace(fqn=fqn, start=0, stop=numel, numel=numel), at))
        at += numel
    partition = SimpleNamespace(offsets=offsets)
    return SimpleNamespace(partition=partition, columns=SimpleNamespace(partition=partition))


def _params(sizes: dict[str, int]) -> dict[str, nn.Parameter]:
    return {name: nn.Parameter(torch.zeros(n)) for name, n in sizes.items()}


def test_a_group_two_units_need_gets_a_storage_of_its_own():
    """Group 1 is gathered by two units: sharing a storage with either unit's other group, a
    release of that unit would free it under the other."""
    params = _params({"a": 3, "b": 2, "c": 4, "d": 5})
    slots = [_slot([("a", 3), ("b", 2)]), _slot([("c", 4)]), _slot([("d", 5)])]
    sets = storage_sets(params, slots, [[0, 1], [1, 2]])
    assert sorted(sorted(s) for s in sets) == [[0], [1], [2]], sets
    assert storage_sets(params, slots, [[0, 1], [2]]) == [[0, 1], [2]]  # the control


def test_a_padded_partition_of_an_odd_sized_shared_group_stays_in_its_group():
    """Group 0 (5 elements) is padded to 6 for two ranks; its padding, written into the
    storage it shares with group 1, must not land on group 1's first element."""
    params = _params({"a": 5, "b": 4})
    storage = GroupStorage(params, [_slot([("a", 5)]), _slot([("b", 4)])], [[0, 1]])
    assert storage.size == {0: 9, 1: 9}
    for i in (0, 1):
        storage.allocate(i)
    storage.write(1, 0, 4, torch.tensor([10.0, 11.0, 12.0, 13.0]))
    storage.write(0, 0, 6, torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 99.0]))  # 99: padding
    assert params["a"].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert params["b"].tolist() == [10.0, 11.0, 12.0, 13.0]
