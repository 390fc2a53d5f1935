"""The plan's view of a torch model: its parameter specs and the config's user-group rule.

``param_specs`` turns any ``nn.Module`` containing moezero ``MoE`` layers into the plan's
``ParamSpec``s (every expert by global index, also those held by other EP ranks);
``config_user_group`` is the rule that puts each parameter in a user hyperparameter group
(no weight decay where the plan's ``weight_decay_applies`` says so: norm gains, biases;
optional expert and router learning rates). Both the optimizer (``moezero.zero.groups``) and
the checkpoint (``moezero.checkpoint.core``, the HF importer) plan from them, so they live
here, below both (docs/design.md, "Who imports whom"). Reference counterpart:
``reference/zero_layout.py: param_specs``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from moezero.model.moe import ExpertTag, MoE, expert_tag
from moezero.plan.rules import expert_fqn, parse_expert_fqn, weight_decay_applies
from moezero.plan.specs import ParamSpec, UserGroup

if TYPE_CHECKING:  # the model imports no pydantic (benchmarks' peer venvs build it bare)
    from moezero.config import Config
    from moezero.config.schema import OptimizerConfig

UserGroupFn = Callable[[str, nn.Parameter], UserGroup]


def config_user_group(cfg: Config) -> UserGroupFn:
    """User groups from the config: decay / no_decay, times expert / router / dense
    (``ConfigUserGroup``)."""
    return ConfigUserGroup(cfg.optimizer)


@dataclass(frozen=True)
class ConfigUserGroup:
    """The config's user-group rule; ``lr_scale`` is relative to ``optimizer.lr`` so one
    schedule drives every group.

    Its answer for an expert parameter depends on the name within the expert, the shape and
    the tag's presence, never on the expert index (the name suffixes it tests hold no digit,
    the index is all digits), so ``param_specs`` asks once per layer and name
    (``same_for_every_expert``: any ``UserGroupFn`` may declare it).
    """

    optimizer: OptimizerConfig
    same_for_every_expert: ClassVar[bool] = True

    def __call__(self, fqn: str, param: nn.Parameter) -> UserGroup:
        opt = self.optimizer
        no_decay = opt.no_decay_on_norms and not weight_decay_applies(fqn, param.shape)
        kind, lr = "", opt.lr
        if expert_tag(param) is not None and opt.expert_lr is not None:
            kind, lr = "expert_", opt.expert_lr
        elif fqn.endswith("router.weight") and opt.router_lr is not None:
            kind, lr = "router_", opt.router_lr
        name = f"{kind}{'no_decay' if no_decay else 'decay'}"
        return UserGroup(name, {"weight_decay": 0.0 if no_decay else opt.weight_decay,
                                "lr_scale": lr / opt.lr})


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
        if layer not in done:
            decide = _ExpertGroups(user_group, groups, present, tag)
            for e in range(moe.num_experts):
                for rest, shape in _shapes(moe, layer, e).items():
                    name = expert_fqn(layer, e, rest)
                    specs[name] = ParamSpec(name, shape, _dtype(param), decide(name, rest, shape, e),
                                            tag.group_name, tag.ep_size, layer, e)
        done.add(layer)
    return list(specs.values()), list(groups.values())


@dataclass
class _ExpertGroups:
    """User-group names of one MoE layer's expert params (``groups`` collects the groups);
    asked once per (name within the expert, shape, tagged) when the rule is
    ``same_for_every_expert``, else once per expert param, on the param itself or, for
    another EP rank's, on a stand-in (``_meta_param``)."""

    user_group: UserGroupFn
    groups: dict[str, UserGroup]
    present: dict[str, nn.Parameter]
    tag: ExpertTag
    known: dict[tuple, str] = field(default_factory=dict)

    def __call__(self, name: str, rest: str, shape: tuple[int, ...], e: int) -> str:
        target = self.present.get(name)
        key = (rest, shape, target is None or expert_tag(target) is not None)
        if key in self.known:
            return self.known[key]
        if target is None:  # held by another EP rank
            target = _meta_param(shape, ExpertTag(self.tag.group_name, self.tag.ep_size, e))
        ug = self.groups.setdefault(*_user_group(self.user_group, name, target))
        if getattr(self.user_group, "same_for_every_expert", False):
            self.known[key] = ug.name
        return ug.name


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


def _dtype(param: nn.Parameter) -> str:
    return str(param.dtype).removeprefix("torch.")
