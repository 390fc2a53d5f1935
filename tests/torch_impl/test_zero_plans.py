"""The pure plans inside the optimizers, without processes: the reduction's buckets and the
all-gather buckets (``moezero.zero.buckets``, unpacked by ``moezero.zero.allgather``) and the
stage-3 gather units (``moezero.zero.gather.plan_units``).

Expectations are built here by brute force (element by element) or written out by hand.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moezero.config import Config
from moezero.model.build import config_decoder
from moezero.plan.partition import Partition
from moezero.plan.specs import Slice
from moezero.zero.allgather import Launched, launch
from moezero.zero.buckets import (
    GatherBucket,
    GroupColumns,
    full_columns,
    plan_buckets,
    plan_gathers,
    scatter_columns,
)
from moezero.zero.gather_units import GatherUnit, param_kind, plan_units, unit_modules


def partition(name: str, sizes: list[tuple[str, int, int]], dp_size: int) -> Partition:
    """A group of member slices ``(fqn, start, stop)`` padded to a multiple of ``dp_size``."""
    offsets, cursor = [], 0
    for fqn, start, stop in sizes:
        offsets.append((Slice(fqn, start, stop), cursor))
        cursor += stop - start
    padded = -(-cursor // dp_size) * dp_size
    return Partition(name, dp_size, 1, cursor, padded, padded // dp_size, tuple(offsets))


def member_of(part: Partition, element: int) -> tuple[str, int]:
    """(fqn, element of that param) of one group element, by a linear scan."""
    for member, off in part.offsets:
        if off <= element < off + member.numel:
            return member.fqn, member.start + element - off
    raise AssertionError(element)


# ---------------------------------------------------------------------------- columns
groups_st = st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=4), min_size=1, max_size=4)


def some_groups(sizes: list[list[int]], dp_size: int) -> list[Partition]:
    return [partition(f"g{g}", [(f"p{g}.{m}", 2, 2 + n) for m, n in enumerate(members)], dp_size)
            for g, members in enumerate(sizes)]


@settings(max_examples=60, deadline=None)
@given(sizes=groups_st, dp_size=st.integers(1, 4), full=st.booleans())
def test_cells_and_members_cover_every_element_once(sizes, dp_size, full):
    for part in some_groups(sizes, dp_size):
        cols = full_columns(part) if full else scatter_columns(part)
        seen = []
        for d, lo, hi in cols.cells(0, cols.cols):
            assert lo == d * cols.cols and lo < hi <= part.numel
            for fqn, start, at, count in cols.members_in(lo, hi):
                got = [(fqn, start + i) for i in range(count)]
                assert got == [member_of(part, e) for e in range(lo + at, lo + at + count)]
                seen += range(lo + at, lo + at + count)
        assert seen == list(range(part.numel))  # once each, in order; padding never read


def test_scatter_and_full_columns_shapes():
    part = partition("g", [("a", 0, 5), ("b", 3, 6)], 3)  # 8 elements, padded to 9
    assert (scatter_columns(part).rows, scatter_columns(part).cols) == (3, 3)
    assert (full_columns(part).rows, full_columns(part).cols) == (1, 8)
    assert list(scatter_columns(part).cells(1, 3)) == [(0, 1, 3), (1, 4, 6), (2, 7, 8)]


# ---------------------------------------------------------------------------- buckets
@settings(max_examples=60, deadline=None)
@given(kinds=st.lists(groups_st, min_size=1, max_size=3), dp_size=st.integers(1, 4),
       cap=st.integers(1, 40), full=st.booleans())
def test_buckets_tile_every_kind_within_the_cap(kinds, dp_size, cap, full):
    columns = full_columns if full else scatter_columns
    parts = [[columns(p) for p in some_groups(sizes, dp_size)] for sizes in kinds]
    members = [m.fqn for groups in parts for g in groups for m, _ in g.partition.offsets]
    order = {fqn: i for i, fqn in enumerate(members)}
    buckets = plan_buckets(parts, order, cap)
    assert plan_buckets(parts, order, cap) == buckets  # deterministic, comparable data
    rows = 1 if full else dp_size
    for k, groups in enumerate(parts):
        mine = [b for b in buckets if b.kind == k]
        assert all(b.cols * rows <= max(cap, rows) for b in mine)
        covered = {}
        for b in mine:
            for gi, a, z in b.pieces:
                covered.setdefault(gi, []).append((a, z))
            touched = {f for gi, a, z in b.pieces for _, lo, hi in groups[gi].cells(a, z)
                       for f, *_ in groups[gi].members_in(lo, hi)}
            assert set(b.fqns) == touched and len(b.fqns) == len(touched)
        for gi, g in enumerate(groups):  # each group's columns exactly once, in order
            spans = covered[gi]
            assert spans[0][0] == 0 and spans[-1][1] == g.cols
            assert all(z == a for (_, z), (a, _) in zip(spans, spans[1:], strict=False))


def test_buckets_follow_backward_order_and_fill_up_to_the_cap():
    """Groups whose first param registered last come first; a bucket takes columns of the
    next group once the previous one is done; every bucket but the last is full."""
    early = partition("early", [("a", 0, 4)], 2)  # 2 columns of 2 rows
    late = partition("late", [("z", 0, 6)], 2)  # 3 columns
    groups = [scatter_columns(early), scatter_columns(late)]
    buckets = plan_buckets([groups], {"a": 0, "z": 1}, cap=4)  # 2 columns per bucket
    assert [b.pieces for b in buckets] == [((1, 0, 2),), ((1, 2, 3), (0, 0, 1)), ((0, 1, 2),)]
    assert [b.fqns for b in buckets] == [("z",), ("z", "a"), ("a",)]
    assert all(b.kind == 0 for b in buckets) and buckets[0].cols == 2


def test_full_columns_buckets_are_element_ranges():
    g = full_columns(partition("g", [("a", 0, 5), ("b", 0, 5)], 4))
    buckets = plan_buckets([[g]], {"a": 0, "b": 1}, cap=4)
    assert [b.pieces for b in buckets] == [((0, 0, 4),), ((0, 4, 8),), ((0, 8, 10),)]
    assert [b.fqns for b in buckets] == [("a",), ("a", "b"), ("b",)]


# ---------------------------------------------------------------------------- gather units
def test_units_written_out_by_hand():
    modules = ["", "layers.0", "layers.0.moe", "layers.1"]
    kinds = {"emb.weight": "dense", "layers.0.attn.w": "dense",
             "layers.0.moe.router.weight": "dense", "layers.0.moe.experts.0.w1": "moe/x/ep1",
             "layers.1.w": "dense", "head.weight": "dense"}
    members = [["emb.weight", "head.weight"], ["layers.0.attn.w"],
               ["layers.0.moe.router.weight", "layers.1.w"], ["layers.0.moe.experts.0.w1"]]
    assert plan_units(modules, kinds, members) == (
        GatherUnit("<root>[dense]", "", frozenset({"emb.weight", "head.weight"}), (0,)),
        GatherUnit("layers.0[dense]", "layers.0", frozenset({"layers.0.attn.w"}), (1,)),
        GatherUnit("layers.0.moe[dense]", "layers.0.moe",
                   frozenset({"layers.0.moe.router.weight"}), (2,)),
        GatherUnit("layers.0.moe[moe/x/ep1]", "layers.0.moe",
                   frozenset({"layers.0.moe.experts.0.w1"}), (3,)),
        GatherUnit("layers.1[dense]", "layers.1", frozenset({"layers.1.w"}), (2,)))


def test_a_unit_needs_the_closure_of_its_groups():
    """A param sliced across groups 0 and 1 pulls in group 1, whose other member pulls in
    group 2: the unit gathers every group it could touch."""
    kinds = {"u.a": "dense", "u.b": "dense", "v.c": "dense", "v.d": "dense"}
    members = [["u.a", "u.b"], ["u.b", "v.c"], ["v.c"], ["v.d"]]
    units = plan_units(["", "u", "v"], kinds, members)
    assert [(u.name, u.slots) for u in units] == [("u[dense]", (0, 1, 2)),
                                                  ("v[dense]", (0, 1, 2, 3))]


def test_the_roots_children_are_units_only_where_their_groups_are_their_own():
    """Per-block dense groups: the embedding and the head are gathered around their own calls;
    one dense group: they stay in the root's unit (else each block would gather it again)."""
    modules, own = ["", "emb", "layers.0", "head"], frozenset({"emb", "head"})
    kinds = {"emb.weight": "dense", "layers.0.w": "dense", "head.weight": "dense"}
    split = plan_units(modules, kinds, [["emb.weight"], ["layers.0.w"], ["head.weight"]], own)
    assert [(u.name, u.slots) for u in split] == [("emb[dense]", (0,)), ("layers.0[dense]", (1,)),
                                                  ("head[dense]", (2,))]
    one = plan_units(modules, kinds, [["emb.weight", "layers.0.w", "head.weight"]], own)
    assert [(u.name, u.fqns, u.slots) for u in one] == [
        ("<root>[dense]", frozenset({"emb.weight", "head.weight"}), (0,)),
        ("layers.0[dense]", frozenset({"layers.0.w"}), (0,))]


@pytest.mark.parametrize("num_experts", [1, 4])
def test_decoder_units_own_every_param_once_and_split_moe_layers(num_experts):
    cfg = Config()
    cfg.model = cfg.model.model_copy(update={"dim": 16, "n_layers": 2, "n_heads": 2, "ffn_dim": 8})
    cfg.moe = cfg.moe.model_copy(update={"num_experts": num_experts, "top_k": 1, "ep_size": 1})
    model = config_decoder(cfg, where="meta")
    modules = [n for n, _ in unit_modules(model)]
    kinds = {fqn: param_kind(p) for fqn, p in model.named_parameters()}
    units = plan_units(modules, kinds, [[fqn] for fqn in kinds])  # one group per param
    owned = [f for u in units for f in u.fqns]
    assert sorted(owned) == sorted(kinds) and len(owned) == len(set(owned))
    for u in units:
        assert u.slots == tuple(sorted(list(kinds).index(f) for f in u.fqns))
        assert {kinds[f] for f in u.fqns} == {u.name.rpartition("[")[2][:-1]}
    moe_units = [u for u in units if kinds[next(iter(u.fqns))] != "dense"]
    assert len(moe_units) == cfg.model.n_layers  # the experts of each MoE layer, apart


def test_group_columns_are_frozen():
    g = scatter_columns(partition("g", [("a", 0, 3)], 1))
    with pytest.raises(AttributeError):
        g.rows = 2  # type: ignore[misc]
    assert isinstance(g, GroupColumns)


# ---------------------------------------------------------------------------- gather buckets
channels_st = st.lists(st.tuples(st.sampled_from(["world", "edp2"]), st.integers(1, 30)),
                       min_size=1, max_size=12)


def gather_groups(specs: list[tuple[str, int]], rows: dict[str, int]) -> list:
    """(key, channel, scatter columns) of one-member groups of the given sizes."""
    return [(10 + i, channel, scatter_columns(partition(f"g{i}", [(f"p{i}", 0, n)], rows[channel])))
            for i, (channel, n) in enumerate(specs)]


@settings(max_examples=80, deadline=None)
@given(specs=channels_st, world=st.integers(1, 4), cap=st.one_of(st.none(), st.integers(1, 50)))
def test_gather_buckets_tile_each_channel_within_the_cap(specs, world, cap):
    rows = {"world": world, "edp2": max(1, world // 2)}
    groups = gather_groups(specs, rows)
    buckets = plan_gathers(groups, cap)
    assert plan_gathers(groups, cap) == buckets  # deterministic, comparable data
    seen = list(dict.fromkeys(channel for _, channel, _ in groups))
    assert list(dict.fromkeys(b.channel for b in buckets)) == seen  # channel by channel
    for channel in seen:
        mine = [b for b in buckets if b.channel == channel]
        members = [(key, c) for key, ch, c in groups if ch == channel]
        assert all(b.rows == rows[channel] for b in mine)
        pieces = [p for b in mine for p in b.pieces]
        # every group's columns once, in the listed order, contiguous
        assert [(k, a, b) for k, a, b in pieces if a < b] == pieces
        for key, c in members:
            spans = [(a, b) for k, a, b in pieces if k == key]
            assert spans[0][0] == 0 and spans[-1][1] == c.cols
            assert all(z == a for (_, z), (a, _) in zip(spans, spans[1:], strict=False))
        assert [k for k, _, _ in pieces] == sorted((k for k, _, _ in pieces),
                                                   key=[k for k, _ in members].index)
        if cap is None:  # one bucket per group
            assert [b.pieces for b in mine] == [((k, 0, c.cols),) for k, c in members]
        else:  # as few buckets as the cap allows: flat in the number of groups
            per = max(1, cap // rows[channel])
            assert all(b.rows * b.cols <= max(cap, b.rows) for b in mine)
            assert len(mine) == -(-sum(c.cols for _, c in members) // per)


def test_gather_buckets_written_out_by_hand():
    rows = {"world": 2, "edp2": 1}
    groups = gather_groups([("world", 4), ("edp2", 3), ("world", 6), ("world", 1)], rows)
    # world: shards of 2, 3 and 1 columns (2 rows), cap 6 elements = 3 columns per bucket
    buckets = plan_gathers(groups, 6)
    assert buckets == (GatherBucket("world", 2, ((10, 0, 2), (12, 0, 1))),
                       GatherBucket("world", 2, ((12, 1, 3), (13, 0, 1))),
                       GatherBucket("edp2", 1, ((11, 0, 3),)))
    assert (buckets[0].cols, buckets[1].cols, buckets[2].cols) == (3, 3, 3)
    columns = {key: c for key, _, c in groups}
    assert [b.whole(columns[b.pieces[0][0]]) for b in buckets] == [False, False, True]
    single = plan_gathers(groups[:1], None)[0]
    assert single.whole(groups[0][2])  # 4 elements = 2 rows x 2 columns, no padding
    padded = gather_groups([("world", 5)], rows)[0][2]  # 5 elements in 2 x 3
    assert not plan_gathers([(0, "world", padded)], None)[0].whole(padded)


@settings(max_examples=60, deadline=None)
@given(specs=channels_st, world=st.integers(1, 4), cap=st.one_of(st.none(), st.integers(1, 50)))
def test_gathered_buckets_rebuild_every_group(specs, world, cap):
    """Simulated all-gathers (each rank's send buffer stacked, as the collective returns it)
    unpacked by ``Launched.unpack``: every group's elements come back, padding never written."""
    rows = {"world": world, "edp2": max(1, world // 2)}
    groups = gather_groups(specs, rows)
    columns = {key: c for key, _, c in groups}
    full = {key: torch.arange(c.numel, dtype=torch.float32) + 100 * key for key, c in columns.items()}

    def shard(key: int, d: int) -> torch.Tensor:
        c = columns[key]
        out = torch.full((c.cols,), float("nan"))  # padding: never unpacked
        got = full[key][d * c.cols:(d + 1) * c.cols]
        out[:got.numel()] = got
        return out

    rebuilt = {key: torch.full((c.numel,), -1.0) for key, c in columns.items()}
    for bucket in plan_gathers(groups, cap):
        if bucket.rows == 1:  # no collective: the pieces are read as they are
            done = launch(bucket, lambda k: shard(k, 0), group=None)
            assert done.recv is None and done.held == 0
        else:
            sends = [torch.cat([shard(k, d)[a:b] for k, a, b in bucket.pieces])
                     for d in range(bucket.rows)]
            done = Launched(bucket, [sends[0]], torch.stack(sends), held=0)
        for key in dict.fromkeys(k for k, _, _ in bucket.pieces):
            done.unpack(key, columns[key], lambda lo, hi, v, key=key: rebuilt[key][lo:hi].copy_(v))
    for key in columns:
        assert torch.equal(rebuilt[key], full[key]), key
