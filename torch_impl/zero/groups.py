"""Optimizer groups of a torch model, built from the plan in ``reference/plan``.

Takes the model's ``ParamSpec``s and user groups (``moezero.model.specs``: every expert by
global index, also those held by other EP ranks; user groups from the config or from a
caller's function), asks the plan for the groups, and keeps the ones whose parameters live on
this rank. Reference counterpart: ``reference/plan/grouping.py``.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

from torch import nn

from moezero.config import Config, ConfigError
from moezero.distributed.topology import Topology
from moezero.model.specs import UserGroupFn, config_user_group, param_specs
from moezero.plan.freeze import freeze_patterns, frozen_fqns
from moezero.plan.grouping import GroupPlan, plan_groups
from moezero.plan.partition import Partition, plan_partitions
from moezero.plan.specs import ParamSpec, UserGroup


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
                         split_by_expert=cfg.moe.split_groups_by_expert,
                         split_dense_by_layer=cfg.moe.split_dense_by_layer)
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
