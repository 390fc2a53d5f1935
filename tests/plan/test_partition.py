"""Tests of ``moezero.plan.partition``: literal layouts, topology, and random-model properties."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moezero.plan import (
    ParamSpec,
    Slice,
    edp_group_ranks,
    edp_rank,
    ep_group_ranks,
    ep_rank,
    plan_groups,
    plan_partitions,
)

from .models import caps, example_model, models

SETTINGS = settings(max_examples=60, deadline=None)


def layout(partition):
    """Every DP rank's (fqn, start, stop, offset in shard) pieces, for literal comparison."""
    return [[(s.fqn, s.start, s.stop, off) for s, off in partition.rank_slices(d)]
            for d in range(partition.dp_size)]


# ---------------------------------------------------------------- literal examples


def test_dense_group_over_four_ranks():
    groups = plan_groups(example_model())
    no_decay = plan_partitions(groups, world_size=4)[1]
    assert (no_decay.group, no_decay.dp_size, no_decay.numel, no_decay.padded_numel,
            no_decay.shard_numel) == ("dense/no_decay/0", 4, 6, 8, 2)
    assert no_decay.offsets == ((Slice("layers.2.norm.weight", 0, 3), 0),
                                (Slice("layers.10.norm.weight", 0, 3), 3))
    assert [no_decay.rank_range(d) for d in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert layout(no_decay) == [
        [("layers.2.norm.weight", 0, 2, 0)],
        [("layers.2.norm.weight", 2, 3, 0), ("layers.10.norm.weight", 0, 1, 1)],
        [("layers.10.norm.weight", 1, 3, 0)],
        [],
    ]


def test_alignment_pads_to_dp_size_times_align():
    groups = plan_groups(example_model())
    decay = plan_partitions(groups, world_size=2, align=4)[0]
    assert (decay.numel, decay.padded_numel, decay.shard_numel, decay.align) == (6, 8, 4, 4)
    assert layout(decay) == [[("embed.weight", 0, 4, 0)], [("embed.weight", 4, 6, 0)]]


def test_expert_group_lives_on_its_edp_group():
    groups = plan_groups(example_model())
    part = plan_partitions(groups, world_size=4)[-1]
    assert part.group == "moe/ep_size_2/layers.10.moe/expert1/decay/0"
    assert (part.dp_size, part.ep_size, part.ep_rank, part.ranks) == (2, 2, 1, (1, 3))
    assert [part.dp_rank(r) for r in part.ranks] == [0, 1]
    with pytest.raises(ValueError, match="rank 2 does not hold it"):
        part.dp_rank(2)
    assert layout(part) == [[("layers.10.moe.experts.1.w1.weight", 0, 2, 0)],
                            [("layers.10.moe.experts.1.w1.weight", 2, 4, 0)]]


def test_topology_blocks_and_strides():
    assert ep_group_ranks(5, world_size=8, ep_size=4) == (4, 5, 6, 7)
    assert edp_group_ranks(5, world_size=8, ep_size=4) == (1, 5)
    assert (ep_rank(5, ep_size=4), edp_rank(5, ep_size=4)) == (1, 1)
    assert edp_group_ranks(3, world_size=4, ep_size=1) == (0, 1, 2, 3)


@pytest.mark.parametrize("call, message", [
    (lambda g: plan_partitions(g, world_size=3), "ep_size 2 does not divide world_size 3"),
    (lambda g: plan_partitions(g, world_size=0), "world_size must be >= 1"),
    (lambda g: plan_partitions(g, world_size=2, align=0), "align must be >= 1"),
    (lambda g: plan_partitions(g, world_size=2)[0].rank_range(2), r"dp_rank 2 not in \[0, 2\)"),
    (lambda g: ep_group_ranks(4, world_size=4, ep_size=2), "rank 4 is out of range"),
    (lambda g: edp_group_ranks(0, world_size=6, ep_size=4), "ep_size 4 does not divide"),
])
def test_bad_topology_is_a_one_line_value_error(call, message):
    with pytest.raises(ValueError, match=message) as info:
        call(plan_groups(example_model()))
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------- random models


@SETTINGS
@given(models(), caps, st.booleans(), st.integers(1, 4), st.integers(1, 2))
def test_partitions_tile_and_reassemble_every_member(model, cap, split, align, scale):
    specs, world_size = model
    world_size *= scale
    groups = plan_groups(specs, max_group_size=cap, split_by_expert=split)
    parts = plan_partitions(groups, world_size=world_size, align=align)
    assert [p.group for p in parts] == [g.name for g in groups]
    for g, p in zip(groups, parts, strict=True):
        assert p.dp_size == world_size // g.ep_size and p.numel == g.numel
        assert p.padded_numel % (p.dp_size * p.align) == 0
        assert 0 <= p.padded_numel - p.numel < p.dp_size * p.align
        assert p.shard_numel * p.dp_size == p.padded_numel and p.shard_numel % align == 0
        check_offsets(g, p)
        check_rank_ranges(p)
        check_rank_slices(p)


def check_offsets(group, part):
    """Members are laid out contiguously in group order from 0, with no gaps."""
    assert [s for s, _ in part.offsets] == list(group.members)
    ends = [0] + [off + s.numel for s, off in part.offsets]
    assert [off for _, off in part.offsets] == ends[:-1] and ends[-1] == part.numel


def check_rank_ranges(part):
    """The DP ranks' ranges tile the padded buffer in order."""
    ranges = [part.rank_range(d) for d in range(part.dp_size)]
    assert ranges[0][0] == 0 and ranges[-1][1] == part.padded_numel
    assert all(a[1] == b[0] and a[1] - a[0] == part.shard_numel for a, b in pairwise(ranges))


def check_rank_slices(part):
    """Every member element is reported by exactly one rank, at its buffer position."""
    owner = [None] * part.padded_numel
    for d in range(part.dp_size):
        lo, hi = part.rank_range(d)
        for piece, shard_off in part.rank_slices(d):
            assert 0 <= shard_off and shard_off + piece.numel <= hi - lo
            for k in range(piece.numel):
                assert owner[lo + shard_off + k] is None
                owner[lo + shard_off + k] = (piece.fqn, piece.start + k)
    expected = [(s.fqn, s.start + k) for s, _ in part.offsets for k in range(s.numel)]
    assert owner[:part.numel] == expected
    assert owner[part.numel:] == [None] * (part.padded_numel - part.numel)


@SETTINGS
@given(models(), st.booleans())
def test_expert_groups_live_on_the_ranks_that_hold_their_experts(model, split):
    specs, world_size = model
    by_fqn = {s.fqn: s for s in specs}
    groups = plan_groups(specs, split_by_expert=split)
    for g, p in zip(groups, plan_partitions(groups, world_size=world_size), strict=True):
        assert len(p.ranks) == p.dp_size
        for rank in p.ranks:
            assert p.dp_rank(rank) == edp_rank(rank, ep_size=p.ep_size)
            assert set(p.ranks) == set(edp_group_ranks(rank, world_size=world_size, ep_size=p.ep_size))
            if g.is_expert:
                assert ep_rank(rank, ep_size=g.ep_size) == g.ep_rank
                assert all(by_fqn[m.fqn].ep_size == g.ep_size for m in g.members)


@SETTINGS
@given(st.sampled_from((1, 2, 4, 8)), st.integers(1, 4))
def test_ep_and_edp_groups_form_a_grid(ep, multiple):
    world_size = ep * multiple
    ep_groups = {ep_group_ranks(r, world_size=world_size, ep_size=ep) for r in range(world_size)}
    edp_groups = {edp_group_ranks(r, world_size=world_size, ep_size=ep) for r in range(world_size)}
    assert sorted(r for grp in ep_groups for r in grp) == list(range(world_size))
    assert sorted(r for grp in edp_groups for r in grp) == list(range(world_size))
    assert all(len(set(a) & set(b)) == 1 for a in ep_groups for b in edp_groups)
    for r in range(world_size):
        assert ep_group_ranks(r, world_size=world_size, ep_size=ep).index(r) == ep_rank(r, ep_size=ep)
        assert edp_group_ranks(r, world_size=world_size, ep_size=ep).index(r) == edp_rank(r, ep_size=ep)


def test_partition_is_printable_and_comparable():
    groups = plan_groups([ParamSpec("w", (3,))])
    a, b = plan_partitions(groups, world_size=2), plan_partitions(groups, world_size=2)
    assert a == b and hash(a) == hash(b)
    assert "Partition(group='dense/default/0'" in repr(a[0])
