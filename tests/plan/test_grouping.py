"""Tests of ``moezero.plan.grouping``: literal examples, then properties over random models."""

from __future__ import annotations

import re
from collections import defaultdict
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moezero.plan import (
    ParamSpec,
    Slice,
    UserGroup,
    expert_ep_rank,
    group_hparams,
    locate_params,
    natural_key,
    plan_groups,
)

from .models import caps, example_model, expert, models

SETTINGS = settings(max_examples=60, deadline=None)


def summary(groups):
    """Each group as (name, [(fqn, start, stop), ...]) for literal comparison."""
    return [(g.name, [(m.fqn, m.start, m.stop) for m in g.members]) for g in groups]


# ---------------------------------------------------------------- literal examples


def test_example_split_by_expert_names_and_order():
    assert summary(plan_groups(example_model())) == [
        ("dense/decay/0", [("embed.weight", 0, 6)]),
        ("dense/no_decay/0", [("layers.2.norm.weight", 0, 3), ("layers.10.norm.weight", 0, 3)]),
        ("moe/ep_size_2/layers.2.moe/expert0/decay/0", [("layers.2.moe.experts.0.w1.weight", 0, 4)]),
        ("moe/ep_size_2/layers.2.moe/expert1/decay/0", [("layers.2.moe.experts.1.w1.weight", 0, 4)]),
        ("moe/ep_size_2/layers.10.moe/expert0/decay/0", [("layers.10.moe.experts.0.w1.weight", 0, 4)]),
        ("moe/ep_size_2/layers.10.moe/expert1/decay/0", [("layers.10.moe.experts.1.w1.weight", 0, 4)]),
    ]


def test_example_dense_split_by_layer_names_and_order():
    """One dense group per (block, user group), blocks in natural order; experts unchanged."""
    groups = plan_groups(example_model(), split_dense_by_layer=True)
    assert summary(groups)[:3] == [
        ("dense/embed/decay/0", [("embed.weight", 0, 6)]),
        ("dense/layers.2/no_decay/0", [("layers.2.norm.weight", 0, 3)]),
        ("dense/layers.10/no_decay/0", [("layers.10.norm.weight", 0, 3)]),
    ]
    assert summary(groups)[3:] == summary(plan_groups(example_model()))[2:]
    assert [g.layer for g in groups[:3]] == ["embed", "layers.2", "layers.10"]


def test_example_split_off_groups_by_ep_rank_across_layers():
    assert summary(plan_groups(example_model(), split_by_expert=False, max_group_size=5)) == [
        ("dense/decay/0", [("embed.weight", 0, 5)]),
        ("dense/decay/1", [("embed.weight", 5, 6)]),
        ("dense/no_decay/0", [("layers.2.norm.weight", 0, 3), ("layers.10.norm.weight", 0, 2)]),
        ("dense/no_decay/1", [("layers.10.norm.weight", 2, 3)]),
        ("moe/ep_size_2/ep0/decay/0", [("layers.2.moe.experts.0.w1.weight", 0, 4),
                                       ("layers.10.moe.experts.0.w1.weight", 0, 1)]),
        ("moe/ep_size_2/ep0/decay/1", [("layers.10.moe.experts.0.w1.weight", 1, 4)]),
        ("moe/ep_size_2/ep1/decay/0", [("layers.2.moe.experts.1.w1.weight", 0, 4),
                                       ("layers.10.moe.experts.1.w1.weight", 0, 1)]),
        ("moe/ep_size_2/ep1/decay/1", [("layers.10.moe.experts.1.w1.weight", 1, 4)]),
    ]


def test_example_group_fields():
    groups = plan_groups(example_model(), max_group_size=4)
    g = next(g for g in groups if g.name == "moe/ep_size_2/layers.10.moe/expert1/decay/0")
    assert (g.index, g.user_group, g.moe_group, g.ep_size, g.ep_rank, g.layer, g.expert) == (
        len(groups) - 1, "decay", "ep_size_2", 2, 1, "layers.10.moe", 1)
    assert g.is_expert and g.numel == 4
    dense = groups[0]
    assert (dense.name, dense.moe_group, dense.ep_size, dense.ep_rank, dense.is_expert) == (
        "dense/decay/0", None, 1, 0, False)


def test_first_param_larger_than_cap_makes_no_empty_group():
    # DeepSpeed appends an empty group here and keeps the 10-element param whole.
    groups = plan_groups([ParamSpec("a", (10,)), ParamSpec("b", (1,))], max_group_size=4)
    assert summary(groups) == [
        ("dense/default/0", [("a", 0, 4)]),
        ("dense/default/1", [("a", 4, 8)]),
        ("dense/default/2", [("a", 8, 10), ("b", 0, 1)]),
    ]


def test_scalar_param_and_cap_of_one():
    groups = plan_groups([ParamSpec("s", ()), ParamSpec("v", (2,))], max_group_size=1)
    assert summary(groups) == [("dense/default/0", [("s", 0, 1)]),
                               ("dense/default/1", [("v", 0, 1)]),
                               ("dense/default/2", [("v", 1, 2)])]


def test_empty_model_has_no_groups():
    assert plan_groups([]) == ()


def test_natural_key_orders_digit_runs_by_value():
    names = ["layers.10.w", "layers.2.w", "layers.1.w", "embed", "layers.02.w"]
    assert sorted(names, key=natural_key) == [
        "embed", "layers.1.w", "layers.02.w", "layers.2.w", "layers.10.w"]


def test_expert_ep_rank_blocks():
    assert [expert_ep_rank(e, num_experts=8, ep_size=4) for e in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert expert_ep_rank(5, num_experts=6, ep_size=1) == 0


def test_user_group_is_normalised_and_hparams_resolve():
    a = UserGroup("decay", {"weight_decay": 0.1, "lr": 1e-3})
    assert a == UserGroup("decay", (("lr", 1e-3), ("weight_decay", 0.1)))
    assert a.hparams == (("lr", 1e-3), ("weight_decay", 0.1)) and hash(a) == hash(UserGroup("decay", a.hparams))
    groups = plan_groups([ParamSpec("w", (2,), user_group="decay")])
    assert group_hparams(groups, [a]) == ({"lr": 1e-3, "weight_decay": 0.1},)
    with pytest.raises(ValueError, match="unknown user group 'decay'"):
        group_hparams(groups, [UserGroup("other")])


def test_locate_params_lists_pieces_in_element_order():
    groups = plan_groups([ParamSpec("a", (3,)), ParamSpec("b", (3,))], max_group_size=2)
    assert locate_params(groups) == {
        "a": ((0, Slice("a", 0, 2)), (1, Slice("a", 2, 3))),
        "b": ((1, Slice("b", 0, 1)), (2, Slice("b", 1, 3))),
    }


# ---------------------------------------------------------------- validation

BAD_INPUTS = [
    (lambda: [ParamSpec("w", (2,)), ParamSpec("w", (3,))], {}, "'w' appears twice"),
    (lambda: [ParamSpec("w", (2, 0))], {}, "'w' has no elements"),
    (lambda: [ParamSpec("w", (2,))], {"max_group_size": 0}, "max_group_size"),
    (lambda: [ParamSpec("w", (2,))], {"max_group_size": -3}, "max_group_size"),
    (lambda: [ParamSpec("e", (2,), moe_group="g", expert=0)], {}, "'e': expert param is missing layer"),
    (lambda: [ParamSpec("e", (2,), moe_group="g", layer="l")], {}, "'e': expert param is missing expert"),
    (lambda: [ParamSpec("e", (2,), moe_group="g", layer="l", expert=-1)], {}, "'e': expert must be"),
    (lambda: [ParamSpec("e", (2,), moe_group="g", layer="l", expert=0, ep_size=0)], {}, "'e': ep_size"),
    (lambda: [ParamSpec("d", (2,), expert=3)], {}, "'d': dense param .* sets expert"),
    (lambda: [ParamSpec("d", (2,), layer="l")], {}, "'d': dense param .* sets layer"),
    (lambda: [ParamSpec("d", (2,), user_group="a/b")], {}, "'d': user_group"),
    (lambda: [ParamSpec("d", (-1,))], {}, "'d': shape"),
    (lambda: [expert("x", (2,), layer="l", e=0, ep=1, group="g"),
              expert("y", (2,), layer="m", e=0, ep=2, group="g")], {}, "'y': ep_size 2 differs"),
    (lambda: [expert("x", (2,), layer="l", e=0, ep=1, group="g"),
              expert("y", (2,), layer="l", e=1, ep=1, group="h")], {}, "'y': moe_group 'h' differs"),
    (lambda: [expert("x", (2,), layer="l", e=0, ep=1),
              expert("y", (2,), layer="l", e=2, ep=1)], {}, "layer 'l': experts must be 0..E-1"),
    (lambda: [expert(f"x{e}", (2,), layer="l", e=e, ep=2) for e in range(3)], {}, "layer 'l'"),
]


@pytest.mark.parametrize("make, kwargs, message", BAD_INPUTS)
def test_bad_input_is_a_one_line_value_error(make, kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        plan_groups(make(), **kwargs)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------- random models


def logical_name(group):
    """The group's name without its chunk number."""
    return group.name.rsplit("/", 1)[0]


@SETTINGS
@given(models(), caps, st.booleans())
def test_every_element_is_in_exactly_one_group(model, cap, split):
    specs, _ = model
    groups = plan_groups(specs, max_group_size=cap, split_by_expert=split)
    covered = defaultdict(list)
    for g in groups:
        for m in g.members:
            covered[m.fqn].append((m.start, m.stop))
    assert set(covered) == {s.fqn for s in specs}
    for s in specs:
        ranges = sorted(covered[s.fqn])
        assert ranges[0][0] == 0 and ranges[-1][1] == s.numel
        assert all(a[1] == b[0] for a, b in pairwise(ranges))


@SETTINGS
@given(models(), caps, st.booleans())
def test_groups_are_capped_nonempty_uniquely_named_and_indexed(model, cap, split):
    specs, _ = model
    groups = plan_groups(specs, max_group_size=cap, split_by_expert=split)
    assert [g.index for g in groups] == list(range(len(groups)))
    assert len({g.name for g in groups}) == len(groups)
    for g in groups:
        assert g.members and g.numel > 0
        assert cap is None or g.numel <= cap
        assert re.fullmatch(r".*/(0|[1-9][0-9]*)", g.name)


@SETTINGS
@given(models(), caps, st.booleans(), st.randoms(use_true_random=False))
def test_plan_is_independent_of_input_order(model, cap, split, rng):
    specs, _ = model
    shuffled = list(specs)
    rng.shuffle(shuffled)
    assert plan_groups(shuffled, max_group_size=cap, split_by_expert=split) == plan_groups(
        specs, max_group_size=cap, split_by_expert=split)


@SETTINGS
@given(models(), caps, st.booleans())
def test_groups_never_mix_kinds_moe_groups_ep_ranks_or_user_groups(model, cap, split):
    specs, _ = model
    by_fqn = {s.fqn: s for s in specs}
    num_experts = defaultdict(set)
    for s in specs:
        if s.is_expert:
            num_experts[s.layer].add(s.expert)
    for g in plan_groups(specs, max_group_size=cap, split_by_expert=split):
        for m in g.members:
            s = by_fqn[m.fqn]
            assert (s.moe_group, s.ep_size, s.user_group) == (g.moe_group, g.ep_size, g.user_group)
            if s.is_expert:
                assert s.expert // (len(num_experts[s.layer]) // s.ep_size) == g.ep_rank
                assert (g.layer, g.expert) == ((s.layer, s.expert) if split else (None, None))
            else:
                assert (g.ep_rank, g.layer, g.expert) == (0, None, None)


@SETTINGS
@given(models(), caps, st.booleans())
def test_order_is_dense_then_experts_sorted_then_chunks(model, cap, split):
    specs, _ = model
    groups = plan_groups(specs, max_group_size=cap, split_by_expert=split)

    def order(g):
        chunk = int(g.name.rsplit("/", 1)[1])
        if not g.is_expert:
            return (0, natural_key(g.user_group), chunk)
        layer = natural_key(g.layer) if split else ()
        return (1, natural_key(g.moe_group), layer, g.expert if split else g.ep_rank,
                natural_key(g.user_group), chunk)

    keys = [order(g) for g in groups]
    assert keys == sorted(keys)


def merged_members(groups):
    """Concatenate each logical group's chunks, joining a param's consecutive slices."""
    out = defaultdict(list)
    for g in groups:
        for m in g.members:
            pieces = out[logical_name(g)]
            if pieces and pieces[-1].fqn == m.fqn and pieces[-1].stop == m.start:
                pieces[-1] = Slice(m.fqn, pieces[-1].start, m.stop)
            else:
                pieces.append(m)
    return list(out.items())


@SETTINGS
@given(models(), caps, st.booleans())
def test_capping_only_cuts_the_uncapped_plan(model, cap, split):
    specs, _ = model
    uncapped = plan_groups(specs, split_by_expert=split)
    capped = plan_groups(specs, max_group_size=cap, split_by_expert=split)
    assert all(g.name.endswith("/0") for g in uncapped)
    assert merged_members(capped) == [(logical_name(g), list(g.members)) for g in uncapped]
    for g in uncapped:
        assert [m.fqn for m in g.members] == sorted((m.fqn for m in g.members), key=natural_key)
        assert all(m.start == 0 for m in g.members)


@SETTINGS
@given(models(), st.integers(1, 40))
def test_chunks_are_full_except_the_last_of_each_logical_group(model, cap):
    specs, _ = model
    groups = plan_groups(specs, max_group_size=cap)
    for g, nxt in pairwise(groups):
        if logical_name(nxt) == logical_name(g):
            assert g.numel == cap


@SETTINGS
@given(models())
def test_split_by_expert_holds_exactly_one_layer_expert(model):
    specs, _ = model
    by_fqn = {s.fqn: s for s in specs}
    for g in plan_groups(specs):
        found = {(by_fqn[m.fqn].moe_group, by_fqn[m.fqn].layer, by_fqn[m.fqn].expert) for m in g.members}
        assert found == {(g.moe_group, g.layer, g.expert)}
