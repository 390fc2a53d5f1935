"""Torch optimizer groups from the plan: user hyperparameter groups, per-layer moe group names,
any nn.Module holding MoE layers, and specs for experts held by other EP ranks."""

from __future__ import annotations

from torch import nn

from moezero.config import Config
from moezero.distributed.topology import Topology
from moezero.model.moe import MoE, SwiGLU
from moezero.model.specs import config_user_group, param_specs
from moezero.plan import UserGroup
from moezero.zero.groups import build_groups


class TwoMoE(nn.Module):
    """A user's own model: a projection, a norm, and two MoE layers with their own group names."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.first = MoE(8, SwiGLU(8, 4), num_experts=2, top_k=1, expert_group_name="shared")
        self.second = MoE(8, SwiGLU(8, 4), num_experts=4, top_k=2, expert_group_name="wide")


def names(groups) -> list[str]:
    return [g.name for g in groups.plan]


def test_user_groups_from_config_keep_hyperparameters_apart():
    cfg = Config()
    cfg.optimizer.expert_lr, cfg.optimizer.router_lr = 1.5e-3, 6e-3
    groups = build_groups(TwoMoE(), cfg, Topology(0, 1, (1,)))
    by_name = {g.plan.name: g for g in groups.local}
    # biases and norm params get no weight decay; router and experts their own lr scale
    assert by_name["dense/no_decay/0"].hparams == {"weight_decay": 0.0, "lr_scale": 1.0}
    assert by_name["dense/decay/0"].hparams == {"weight_decay": 0.1, "lr_scale": 1.0}
    assert by_name["dense/router_decay/0"].hparams["lr_scale"] == 2.0
    assert by_name["moe/wide/second/expert3/expert_decay/0"].hparams["lr_scale"] == 0.5
    members = {m.fqn for m in by_name["dense/no_decay/0"].members}
    assert members == {"proj.bias", "norm.weight", "norm.bias"}


def test_each_moe_layer_keeps_its_own_group_name_and_experts_never_mix():
    groups = build_groups(TwoMoE(), Config(), Topology(0, 1, (1,)))
    moe_names = [n for n in names(groups) if n.startswith("moe/")]
    assert moe_names == [f"moe/shared/first/expert{e}/decay/0" for e in range(2)] + \
        [f"moe/wide/second/expert{e}/decay/0" for e in range(4)]
    for g in groups.plan:
        if g.expert is not None:
            assert {m.fqn.split(".")[2] for m in g.members} == {str(g.expert)}


def test_a_custom_user_group_function_is_honoured():
    def by_module(fqn, param):
        return UserGroup("slow" if fqn.startswith("proj") else "fast",
                         {"lr_scale": 0.1 if fqn.startswith("proj") else 1.0})

    groups = build_groups(TwoMoE(), Config(), Topology(0, 1, (1,)), user_group=by_module)
    assert "dense/slow/0" in names(groups) and "dense/fast/0" in names(groups)


def test_specs_cover_experts_held_by_other_ranks():
    model = nn.Module()
    model.moe = MoE(8, SwiGLU(8, 4), num_experts=4, ep_size=2, ep_rank=1)
    specs, _ = param_specs(model, config_user_group(Config()))
    experts = sorted({s.expert for s in specs if s.expert is not None})
    assert experts == [0, 1, 2, 3]  # the rank holds 2 and 3 but plans all four
    assert {name for name, _ in model.named_parameters()} < {s.fqn for s in specs}


def test_cap_slices_a_large_expert_weight_across_groups():
    cfg = Config()
    cfg.moe.max_group_size = 20  # smaller than one 4x8 expert weight (32 elements)
    groups = build_groups(TwoMoE(), cfg, Topology(0, 1, (1,)))
    assert all(g.numel <= 20 for g in groups.plan)
    pieces = [(m.start, m.stop) for g in groups.plan for m in g.members
              if m.fqn == "second.experts.1.w1.weight"]
    assert pieces[0][0] == 0 and pieces[-1][1] == 32 and len(pieces) >= 2


def test_a_user_group_function_may_tell_experts_apart():
    """Only a rule that declares ``same_for_every_expert`` is asked once per layer and name;
    any other is asked for every expert, also those other EP ranks hold."""
    def by_parity(fqn, param):
        parts = fqn.split(".")
        odd = "experts" in parts and int(parts[parts.index("experts") + 1]) % 2
        return UserGroup("odd" if odd else "even")

    model = nn.Module()
    model.moe = MoE(8, SwiGLU(8, 4), num_experts=4, ep_size=2, ep_rank=1)
    specs, _ = param_specs(model, by_parity)
    assert {(s.expert, s.user_group) for s in specs if s.expert is not None} == \
        {(0, "even"), (1, "odd"), (2, "even"), (3, "odd")}
