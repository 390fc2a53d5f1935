"""Tests of ``moezero.plan.rules``: the conventions both sides call instead of restating."""

from __future__ import annotations

import pytest

from moezero.plan import (
    STATES,
    ExpertName,
    check_ep_size,
    ep_size_problem,
    expert_fqn,
    expert_group_name,
    parse_expert_fqn,
    weight_decay_applies,
)


@pytest.mark.parametrize("fqn,parts", [
    ("layers.3.moe.experts.5.w1.weight", ("layers.3.moe", 5, "w1.weight")),
    ("moe.experts.0.w", ("moe", 0, "w")),
    ("a.experts.1.b.experts.12.net.0.weight", ("a.experts.1.b", 12, "net.0.weight")),
])
def test_expert_fqns_parse_into_layer_expert_and_rest_and_back(fqn, parts):
    name = parse_expert_fqn(fqn)
    assert name == ExpertName(*parts) and name.fqn == fqn == expert_fqn(*parts)


def test_the_experts_of_a_layer_on_its_own_are_named_from_experts():
    assert expert_fqn("", 2, "w1.weight") == "experts.2.w1.weight"


@pytest.mark.parametrize("fqn", ["layers.3.moe.router.weight", "experts.1.w", "moe.experts.w1",
                                 "moe.experts.1", "moe.experts.x1.w", "moe.expert.1.w"])
def test_names_without_an_indexed_experts_module_are_not_experts(fqn):
    assert parse_expert_fqn(fqn) is None


def test_expert_group_name_defaults_to_the_ep_size():
    assert expert_group_name(None, ep_size=4) == "ep_size_4"
    assert expert_group_name("", ep_size=1) == "ep_size_1"
    assert expert_group_name("mine", ep_size=4) == "mine"


def test_state_names_are_the_master_then_adams_moments():
    assert STATES == ("master", "exp_avg", "exp_avg_sq")


@pytest.mark.parametrize("ep,world,experts,problem", [
    (2, 4, 8, None), (1, 3, 5, None), (4, None, 8, None), (3, 6, None, None),
    (0, 4, 8, "must be >= 1, got 0"),
    (3, 4, 6, "3 does not divide world_size 4"),
    (4, 4, 6, "4 does not divide num_experts 6"),
])
def test_ep_size_must_divide_the_world_and_the_experts(ep, world, experts, problem):
    assert ep_size_problem(ep, world_size=world, num_experts=experts) == problem
    if problem is None:
        check_ep_size(ep_size=ep, world_size=world, num_experts=experts)
    else:
        with pytest.raises(ValueError, match=f"^ep_size {problem}$"):
            check_ep_size(ep_size=ep, world_size=world, num_experts=experts)


def test_a_world_below_one_is_refused():
    with pytest.raises(ValueError, match="^world_size must be >= 1, got 0$"):
        check_ep_size(ep_size=1, world_size=0)


@pytest.mark.parametrize("fqn,shape,decays", [
    ("embed.weight", (256, 64), True),
    ("layers.0.attn.wq.weight", (64, 64), True),
    ("layers.0.moe.router.weight", (8, 64), True),
    ("layers.0.moe.experts.3.w1.weight", (128, 64), True),  # one expert's own shape
    ("layers.0.attn_norm.weight", (64,), False),
    ("norm.weight", (64,), False),
    ("layers.0.attn.q_norm.weight", (4, 16), False),  # a norm gain by name, whatever its shape
    ("layers.0.attn.wq.bias", (64,), False),
    ("scale", (), False),
])
def test_weight_decay_applies_to_matrices_but_never_to_norm_gains_or_vectors(fqn, shape, decays):
    assert weight_decay_applies(fqn, shape) is decays
