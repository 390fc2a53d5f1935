"""Optimizer groups of a torch model, built from the plan in ``reference/plan``.

Turns any ``nn.Module`` containing moezero ``MoE`` layers into ``ParamSpec``s (every expert by
global index, also those held by other EP ranks), asks the plan for the groups, and keeps the
ones whose parameters live on this rank. User hyperparameter groups come from the config
(no weight decay where the plan's ``weight_decay_applies`` says so: norm gains, biases;
optional expert and router learning rates) or from
a caller's function. Reference counterpart: ``reference/plan/grouping.py``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from moezero.config import Config, ConfigError
from moezero.distributed.topology import Topology
from moezero.model.moe import ExpertTag, MoE, expert_tag
from moezero.plan.freeze import freeze_patterns, frozen_fqns
from moezero.plan.grouping import GroupPlan, plan_groups
from moezero.plan.partition import Partition, plan_partitions
from moezero.plan.rules import expert_fqn, parse_expert_fqn, weight_decay_applies
from moezero.plan.specs import ParamSpec, UserGroup

UserGroupFn = Callable[[str, nn.Parameter], UserGroup]


class PlanMismatchError(ValueError):
    """The ranks' optimizer plans differ (one line, the same on every rank)."""


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
    """Specs of every parameter of the *global* model and the user groups they use.

    Each expert of a MoE layer is specified from its own shapes (``MoE.expert_shapes``), also
    the experts other EP ranks hold, so experts of different shapes plan alike everywhere.
    Raises ValueError (one line naming the layer) when an expert cannot be sized.
    """
    specs: dict[str, ParamSpec] = {}
    groups: dict[str, UserGroup] = {}
    present, done = dict(model.named_parameters()), set()
    for fqn, param in present.items():
        tag = expert_tag(param)
        if tag is None:
            ug = groups.setdefault(*_user_group(user_group, fqn, param))
            specs[fqn] = ParamSpec(fqn, tuple(param.shape), _dtype(param), ug.name)
            continue
        layer, moe = _moe_layer(model, fqn)
        for e in range(moe.num_experts) if layer not in done else ():
            for rest, shape in _shapes(moe, layer, e).items():
                name = expert_fqn(layer, e, rest)
                target = present.get(name)
                if target is None:  # held by another EP rank
                    target = _meta_param(shape, ExpertTag(tag.group_name, tag.ep_size, e))
                ug = groups.setdefault(*_user_group(user_group, name, target))
                specs[name] = ParamSpec(name, shape, _dtype(param), ug.name, tag.group_name,
                                        tag.ep_size, layer, e)
        done.add(layer)
    return list(specs.values()), list(groups.values())


def _user_group(user_group: UserGroupFn, fqn: str, param) -> tuple[str, UserGroup]:
    ug = user_group(fqn, param)
    return ug.name, ug


def _moe_layer(model: nn.Module, fqn: str) -> tuple[str, MoE]:
    parts = parse_expert_fqn(fqn)
    if parts is None:
        raise ValueError(f"{fqn}: expert parameter outside an 'experts.<index>' module")
    moe = model.get_submodule(parts.layer)
    if not isinstance(moe, MoE):
        raise ValueError(f"{fqn}: expert parameter whose layer {parts.layer!r} is not a MoE")
    return parts.layer, moe


def _shapes(moe: MoE, layer: str, e: int) -> dict[str, tuple[int, ...]]:
    try:
        return moe.expert_shapes(e)
    except ValueError as exc:
        raise ValueError(f"{layer}: {exc}") from None


def _meta_param(shape: tuple[int, ...], tag: ExpertTag) -> nn.Parameter:
    """A stand-in for another rank's expert parameter (shape and tag, no memory) for the
    user-group function."""
    param = nn.Parameter(torch.empty(shape, device="meta"))
    param.moe = tag
    return param


@dataclass(frozen=True)
class ModelPlan:
    """A model's plan under a config: its parameter specs (``frozen`` set), user groups,
    optimizer groups and their partitions."""

    specs: list[ParamSpec]
    user_groups: list[UserGroup]
    groups: tuple[GroupPlan, ...]
    partitions: tuple[Partition, ...]


def plan_model(model: nn.Module, cfg: Config, *, world_size: int,
               user_group: UserGroupFn | None = None, align: int = 1) -> ModelPlan:
    """specs -> frozen -> groups -> partitions of ``model`` (every expert, wherever it lives)
    on ``world_size`` ranks: the one derivation the engine (``build_groups``) and the
    estimate (``moezero.estimate``) share. Parameters that ``train.freeze`` (and, under LoRA,
    the base rule) names are frozen (ConfigError, one line, for a pattern that matches
    nothing)."""
    specs, user_groups = param_specs(model, user_group or config_user_group(cfg))
    specs = freeze_specs(specs, freeze_patterns(cfg.train.freeze, lora=cfg.peft.uses_lora))
    groups = plan_groups(specs, max_group_size=cfg.moe.max_group_size,
                         split_by_expert=cfg.moe.split_groups_by_expert)
    partitions = plan_partitions(groups, world_size=world_size, align=align)
    return ModelPlan(specs, user_groups, groups, partitions)


def build_groups(model: nn.Module, cfg: Config, topology: Topology, *,
                 user_group: UserGroupFn | None = None, align: int = 1) -> OptimizerGroups:
    """The plan's groups and partitions (``plan_model``), and the subset this rank holds."""
    planned = plan_model(model, cfg, world_size=topology.world_size, user_group=user_group,
                         align=align)
    plan, partitions = planned.groups, planned.partitions
    present = dict(model.named_parameters())
    hparams = {ug.name: ug.as_dict() for ug in planned.user_groups}
    local = tuple(LocalGroup(g, part, hparams[g.user_group]) for g, part in zip(plan, partitions, strict=True)
                  if all(m.fqn in present for m in g.members))
    return OptimizerGroups(plan, partitions, tuple(planned.user_groups), local)


def freeze_specs(specs: list[ParamSpec], patterns: list[str]) -> list[ParamSpec]:
    """``specs`` with ``frozen`` set on those ``patterns`` freeze (``moezero.plan.freeze``)."""
    try:
        frozen = frozen_fqns(patterns, [s.fqn for s in specs])
    except ValueError as exc:
        raise ConfigError("train.freeze", str(exc), "config") from None
    return [replace(s, frozen=True) if s.fqn in frozen else s for s in specs]


def _dtype(param: nn.Parameter) -> str:
    return str(param.dtype).removeprefix("torch.")


def plan_digest(groups: OptimizerGroups) -> str:
    """A short digest of the plan, partitions and user groups: equal on every rank exactly
    when they plan alike (the ranks compare it at start-up)."""
    text = repr((groups.plan, groups.partitions, groups.user_groups))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_digests(digests: list[str]) -> None:
    """PlanMismatchError unless every rank's ``plan_digest`` (in rank order) is the same."""
    other = next((r for r, d in enumerate(digests) if d != digests[0]), None)
    if other is not None:
        raise PlanMismatchError(
            f"optimizer plans differ across ranks: rank 0 plans {digests[0]}, rank {other} "
            f"plans {digests[other]}; every rank must see the same parameters and expert shapes "
            "(give MoE an expert factory by global index, not a per-rank template)")
