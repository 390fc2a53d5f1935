"""Optimizer groups of a torch model, built from the plan in ``reference/plan``.

Turns any ``nn.Module`` containing moezero ``MoE`` layers into ``ParamSpec``s (every expert by
global index, also those held by other EP ranks), asks the plan for the groups, and keeps the
ones whose parameters live on this rank. User hyperparameter groups come from the config
(no weight decay where the plan's ``weight_decay_applies`` says so: norm gains, biases;
optional expert and router learning rates) or from
a caller's function. Reference counterpart: ``reference/plan/grouping.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from moezero.config import Config
from moezero.distributed.topology import Topology
from moezero.model.moe import MoE, expert_tag
from moezero.plan.grouping import GroupPlan, plan_groups
from moezero.plan.partition import Partition, plan_partitions
from moezero.plan.rules import expert_fqn, parse_expert_fqn, weight_decay_applies
from moezero.plan.specs import ParamSpec, UserGroup

UserGroupFn = Callable[[str, nn.Parameter], UserGroup]


@dataclass(frozen=True)
class LocalGroup:
    """A plan group whose parameters live on this rank, with its hyperparameters."""

    plan: GroupPlan
    partition: Partition
    hparams: dict

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def members(self):
        return self.plan.members


@dataclass(frozen=True)
class OptimizerGroups:
    """The full plan (identical on every rank) and this rank's groups in plan order."""

    plan: tuple[GroupPlan, ...]
    partitions: tuple[Partition, ...]
    user_groups: tuple[UserGroup, ...]
    local: tuple[LocalGroup, ...]


def config_user_group(cfg: Config) -> UserGroupFn:
    """User groups from the config: decay / no_decay, times expert / router / dense.

    ``lr_scale`` is relative to ``optimizer.lr`` so one schedule drives every group.
    """
    opt = cfg.optimizer

    def user_group(fqn: str, param: nn.Parameter) -> UserGroup:
        no_decay = opt.no_decay_on_norms and not weight_decay_applies(fqn, param.shape)
        kind, lr = "", opt.lr
        if expert_tag(param) is not None and opt.expert_lr is not None:
            kind, lr = "expert_", opt.expert_lr
        elif fqn.endswith("router.weight") and opt.router_lr is not None:
            kind, lr = "router_", opt.router_lr
        name = f"{kind}{'no_decay' if no_decay else 'decay'}"
        return UserGroup(name, {"weight_decay": 0.0 if no_decay else opt.weight_decay,
                                "lr_scale": lr / opt.lr})

    return user_group


def param_specs(model: nn.Module, user_group: UserGroupFn) -> tuple[list[ParamSpec], list[UserGroup]]:
    """Specs of every parameter of the *global* model and the user groups they use."""
    specs: dict[str, ParamSpec] = {}
    groups: dict[str, UserGroup] = {}
    for fqn, param in model.named_parameters():
        ug = user_group(fqn, param)
        groups.setdefault(ug.name, ug)
        tag = expert_tag(param)
        if tag is None:
            specs[fqn] = ParamSpec(fqn, tuple(param.shape), _dtype(param), ug.name)
            continue
        parts = parse_expert_fqn(fqn)
        if parts is None:
            raise ValueError(f"{fqn}: expert parameter outside an 'experts.<index>' module")
        moe = model.get_submodule(parts.layer)
        if not isinstance(moe, MoE):
            raise ValueError(f"{fqn}: expert parameter whose layer {parts.layer!r} is not a MoE")
        for e in range(moe.num_experts):  # every expert, wherever it lives
            name = expert_fqn(parts.layer, e, parts.rest)
            specs[name] = ParamSpec(name, tuple(param.shape), _dtype(param), ug.name,
                                    tag.group_name, tag.ep_size, parts.layer, e)
    return list(specs.values()), list(groups.values())


def build_groups(model: nn.Module, cfg: Config, topology: Topology, *,
                 user_group: UserGroupFn | None = None, align: int = 1) -> OptimizerGroups:
    """The plan's groups and partitions, and the subset this rank holds."""
    specs, user_groups = param_specs(model, user_group or config_user_group(cfg))
    plan = plan_groups(specs, max_group_size=cfg.moe.max_group_size,
                       split_by_expert=cfg.moe.split_groups_by_expert)
    partitions = plan_partitions(plan, world_size=topology.world_size, align=align)
    present = dict(model.named_parameters())
    hparams = {ug.name: ug.as_dict() for ug in user_groups}
    local = tuple(LocalGroup(g, part, hparams[g.user_group]) for g, part in zip(plan, partitions, strict=True)
                  if all(m.fqn in present for m in g.members))
    return OptimizerGroups(plan, partitions, tuple(user_groups), local)


def _dtype(param: nn.Parameter) -> str:
    return str(param.dtype).removeprefix("torch.")
