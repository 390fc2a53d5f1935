"""Stage-3 gather units as a pure plan: which module's params are gathered together, and
which optimizer groups each unit needs (``moezero.zero.gather`` has the rules in its module
docs, "Units", and runs the plan). Tested without processes (tests/torch_impl/test_zero_plans.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import nn

from moezero.model.moe import MoE, expert_tag


@dataclass(frozen=True)
class GatherUnit:
    """One module's params of one data-parallel kind and the groups they need."""

    name: str  # "<module>[<kind>]", for messages
    module: str  # the module's name ("" = the root)
    fqns: frozenset[str]
    slots: tuple[int, ...]  # indices into the optimizer's slots, ascending


def unit_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every gather unit in registration (~forward) order; root first. The
    ``own_units`` among them are units only where their groups are their own (``plan_units``)."""
    lists = {n for n, m in model.named_modules() if n and isinstance(m, nn.ModuleList)}
    own = own_units(model)
    return [(name, module) for name, module in model.named_modules()
            if module is model or name in own or name.rpartition(".")[0] in lists
            or isinstance(module, MoE)]


def own_units(model: nn.Module) -> frozenset[str]:
    """The root's children that are units only where no other unit needs their groups: every
    child but a ``ModuleList`` (its modules are units) and a ``MoE`` (always one)."""
    return frozenset(n for n, m in model.named_children()
                     if not isinstance(m, (nn.ModuleList, MoE)))


def param_kind(param: nn.Parameter) -> str:
    """``dense``, or the moe group and EP size of an expert parameter."""
    tag = expert_tag(param)
    return "dense" if tag is None else f"moe/{tag.group_name}/ep{tag.ep_size}"


def plan_units(modules: Sequence[str], kinds: Mapping[str, str],
               slot_members: Sequence[Sequence[str]],
               own: frozenset[str] = frozenset()) -> tuple[GatherUnit, ...]:
    """The gather units, in module order (pure).

    Args:
        modules: Unit module names in forward order, the root ("") first.
        kinds: Every parameter's kind (``param_kind``), in registration order.
        slot_members: Each optimizer group's member FQNs, in slot order.
        own: Modules among ``modules`` that are units only where no other unit needs one of
            their groups; else their params go to the root's unit (``own_units``).

    A parameter belongs to the innermost unit module above it; a unit needs every group
    holding one of its params, closed over the groups of those groups' members.
    """
    slots_of: dict[str, set[int]] = {}
    for i, members in enumerate(slot_members):
        for fqn in members:
            slots_of.setdefault(fqn, set()).add(i)
    owned = _owned(modules, kinds)
    need = {key: _closure(fqns, slots_of, slot_members) for key, fqns in owned.items()}
    for key in [k for k in owned if k[0] in own]:
        others = set().union(*(set(s) for k, s in need.items() if k != key))
        if others & set(need[key]):  # shared: back to the root's unit
            owned.setdefault(("", key[1]), set()).update(owned.pop(key))
            need.pop(key)
            need[("", key[1])] = _closure(owned[("", key[1])], slots_of, slot_members)
    ordered = sorted(owned.items(), key=lambda kv: modules.index(kv[0][0]))
    return tuple(GatherUnit(f"{unit or '<root>'}[{kind}]", unit, frozenset(fqns),
                            need[(unit, kind)]) for (unit, kind), fqns in ordered)


def _owned(modules: Sequence[str], kinds: Mapping[str, str]) -> dict[tuple[str, str], set[str]]:
    """(unit module, kind) -> the params of that kind whose innermost unit module it is."""
    owned: dict[tuple[str, str], set[str]] = {}
    for fqn, kind in kinds.items():
        unit = max((n for n in modules if not n or fqn.startswith(n + ".")), key=len)
        owned.setdefault((unit, kind), set()).add(fqn)
    return owned


def _closure(fqns: set[str], slots_of: dict[str, set[int]],
             slot_members: Sequence[Sequence[str]]) -> tuple[int, ...]:
    """The groups holding ``fqns``, plus the groups of every member of those groups."""
    need, todo = set(), set().union(*(slots_of[f] for f in fqns))
    while todo:
        i = todo.pop()
        need.add(i)
        for fqn in slot_members[i]:
            todo |= slots_of[fqn] - need
    return tuple(sorted(need))
