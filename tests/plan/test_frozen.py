"""Frozen parameters in the plan (``moezero.plan.freeze``, ``ParamSpec.frozen``): which
patterns freeze what, frozen groups after the trained ones (whose names and members are
those of the model without the frozen params), and a layout with weights only for them."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moezero.plan import plan_groups, plan_layout, plan_partitions, rank_ranges
from moezero.plan.freeze import frozen_fqns
from moezero.plan.grouping import frozen_params, trained_groups
from moezero.plan.layout import shapes_of
from moezero.plan.manifest import Manifest, manifest_from_json, manifest_to_json

from .models import example_model, models
from .test_grouping import summary

FQNS = ["embed.weight", "layers.0.moe.router.weight", "layers.0.moe.experts.0.w1.weight",
        "layers.0.moe.experts.1.w1.weight", "norm.weight"]


def freeze(specs, names):
    return [dataclasses.replace(s, frozen=s.fqn in names) for s in specs]


def test_patterns_apply_in_order_and_bang_unfreezes():
    assert frozen_fqns(["*.router.*", "embed.*"], FQNS) == {FQNS[0], FQNS[1]}
    assert frozen_fqns(["*", "!*.experts.*"], FQNS) == {FQNS[0], FQNS[1], FQNS[4]}
    assert frozen_fqns(["*.experts.*", "!*.experts.1.*"], FQNS) == {FQNS[2]}
    assert frozen_fqns([], FQNS) == set()


@pytest.mark.parametrize("patterns,message", [
    (["*.router.*", "*.gate.*"], "pattern '*.gate.*' matches no parameter"),
    (["!"], "pattern '!' matches no parameter"),
    (["*"], "freeze every parameter: nothing to train"),
])
def test_bad_patterns_are_refused_in_one_line(patterns, message):
    with pytest.raises(ValueError, match=message.replace("*", r"\*")):
        frozen_fqns(patterns, FQNS)


def test_frozen_groups_follow_the_trained_ones_which_keep_their_names():
    names = {"embed.weight", "layers.10.moe.experts.1.w1.weight"}
    groups = plan_groups(freeze(example_model(), names))
    assert summary(groups) == [
        ("dense/no_decay/0", [("layers.2.norm.weight", 0, 3), ("layers.10.norm.weight", 0, 3)]),
        ("moe/ep_size_2/layers.2.moe/expert0/decay/0", [("layers.2.moe.experts.0.w1.weight", 0, 4)]),
        ("moe/ep_size_2/layers.2.moe/expert1/decay/0", [("layers.2.moe.experts.1.w1.weight", 0, 4)]),
        ("moe/ep_size_2/layers.10.moe/expert0/decay/0", [("layers.10.moe.experts.0.w1.weight", 0, 4)]),
        ("frozen/dense/decay/0", [("embed.weight", 0, 6)]),
        ("frozen/moe/ep_size_2/layers.10.moe/expert1/decay/0",
         [("layers.10.moe.experts.1.w1.weight", 0, 4)]),
    ]
    assert [g.frozen for g in groups] == [False] * 4 + [True] * 2
    assert len(trained_groups(groups)) == 4
    assert set(frozen_params(groups)) == names


@settings(max_examples=40, deadline=None)
@given(models(), st.data())
def test_frozen_groups_hold_exactly_the_frozen_params_after_the_trained_ones(model, data):
    specs, _ = model
    names = set(data.draw(st.lists(st.sampled_from([s.fqn for s in specs]), unique=True))
                if specs else [])
    groups = plan_groups(freeze(specs, names), max_group_size=7)
    assert [g.index for g in groups] == list(range(len(groups)))
    assert not any(g.frozen for g in groups[:len(trained_groups(groups))])
    assert {m.fqn for g in groups if g.frozen for m in g.members} == names
    assert all(g.name.startswith("frozen/") == g.frozen for g in groups)
    unfrozen = plan_groups(specs, max_group_size=7)
    # each frozen group is the trained group of the same key with "frozen/" in front
    keys = {g.name.rsplit("/", 1)[0] for g in unfrozen}
    assert {g.name.removeprefix("frozen/").rsplit("/", 1)[0] for g in groups} <= keys


def test_layout_of_a_frozen_group_is_weights_only_and_the_manifest_says_so():
    names = {"embed.weight", "layers.2.moe.experts.0.w1.weight"}
    specs = freeze(example_model(), names)
    groups = plan_groups(specs)
    layout = plan_layout(groups, shapes_of(specs), step=3)
    assert len(layout.model_files) == len(groups)
    assert [f.group for f in layout.optim_files] == [g.name for g in trained_groups(groups)]
    assert not layout.weights_only and layout.frozen == names
    parts = plan_partitions(groups, world_size=2)
    for group, part in zip(groups, parts, strict=True):
        ranges = rank_ranges(layout, part, 0)
        assert (ranges.exp_avg is None) == group.frozen
    obj = manifest_to_json(Manifest(layout, ()))
    assert obj["frozen_params"] == sorted(names)
    assert [g.get("frozen", False) for g in obj["groups"]] == [g.frozen for g in groups]
    obj["checksums"] = [[f.name, 0, f.size, 0] for f in layout.files]
    assert manifest_from_json(obj).layout.groups == groups
