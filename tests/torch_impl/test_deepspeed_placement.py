"""Where ``import-deepspeed`` finds each element of a param in DeepSpeed's rank files
(``checkpoint/deepspeed/placement.py``), checked by value (issue 38, a thin catch: mutants of
the ZeRO-3 placement were caught only by a crash further on).

Each rank's vector is built here the way DeepSpeed lays it out (numbered elements, written
from DeepSpeed's rules, not from placement.py): ZeRO-3 splits every param on its own into
``ceil(numel / W)`` elements per rank (the last rank's tail padded) and a rank holds its pieces
back to back; ZeRO-1/2 flatten a group, pad it to a multiple of ``2 W`` and split it evenly.
Every param, and ranges that cross rank borders, must read back its own numbers.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from moezero.checkpoint.deepspeed import placement

GROUPS = [[("a", (5,)), ("b", (3, 4)), ("c", (2,))], [("d", (7, 1)), ("e", (1,))]]


def numbered(groups) -> dict[str, np.ndarray]:
    """Every param's elements numbered from 1 across all params (0 is padding)."""
    out, start = {}, 1
    for group in groups:
        for name, shape in group:
            n = math.prod(shape)
            out[name] = np.arange(start, start + n, dtype=np.int64)
            start += n
    return out


def stage3_vectors(groups, values, world: int) -> list[np.ndarray]:
    ranks = [[] for _ in range(world)]
    for group in groups:
        for name, _ in group:
            per = -(-values[name].size // world)
            padded = np.zeros(per * world, dtype=np.int64)
            padded[:values[name].size] = values[name]
            for r in range(world):
                ranks[r].append(padded[r * per:(r + 1) * per])
    return [np.concatenate(parts) for parts in ranks]


def stage12_vectors(groups, values, world: int) -> list[np.ndarray]:
    ranks = [[] for _ in range(world)]
    for group in groups:
        flat = np.concatenate([values[name] for name, _ in group])
        unit = 2 * world
        padded = np.zeros(-(-flat.size // unit) * unit, dtype=np.int64)
        padded[:flat.size] = flat
        for r, part in enumerate(np.split(padded, world)):
            ranks[r].append(part)
    return [np.concatenate(parts) for parts in ranks]


def read(place, vectors, name: str, a: int, b: int) -> np.ndarray:
    out = np.full(b - a, -1, dtype=np.int64)
    for piece in place.pieces(name, a, b):
        out[piece.start:piece.start + piece.length] = \
            vectors[piece.rank][piece.offset:piece.offset + piece.length]
    return out


@pytest.mark.parametrize("stage,world", [(3, 2), (3, 3), (3, 4), (3, 8), (2, 2), (2, 3),
                                         (1, 4)])
def test_every_element_reads_back_its_own_value(stage, world):
    values = numbered(GROUPS)
    vectors = (stage3_vectors if stage == 3 else stage12_vectors)(GROUPS, values, world)
    place = placement.plan(stage, world, GROUPS)
    assert sum(place.group_numel) == vectors[0].size  # each rank's elements, padding included
    rng = np.random.default_rng(stage * 10 + world)
    for name, want in values.items():
        assert np.array_equal(read(place, vectors, name, 0, want.size), want), name
        for _ in range(5):  # ranges that start and end anywhere, across rank borders
            a, b = sorted(rng.integers(0, want.size + 1, 2))
            assert np.array_equal(read(place, vectors, name, a, b), want[a:b]), (name, a, b)
    assert place.shapes == {name: shape for g in GROUPS for name, shape in g}
