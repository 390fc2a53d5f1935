"""ZeRO-3 parameter gathering: params live as shards; a module's params exist only while used.

**Units.** The model's root, every module of an ``nn.ModuleList`` (the decoder's blocks) and
every ``MoE`` layer are gather units. A unit owns the params below it that no nested unit
owns, split by data-parallel kind (dense params; each moe group's experts), so the dense
part of a MoE layer (its router) and its experts are released independently. A unit needs
every optimizer group holding one of its params, closed over the groups of those groups'
members (a param sliced across groups by ``moe.max_group_size`` is gathered whole). Cap the
groups to make units fine-grained: with one big dense group every dense param is gathered at
once.

**Forward.** A unit's forward pre-hook gathers its groups (all-gather of each group's shard
into a padded temporary, copied into the params' own storage, which is re-allocated for the
purpose) and starts the next unit's gathers asynchronously (prefetch); its forward hook
releases them (``untyped_storage().resize_(0)``: the params keep their shape, autograd keeps
its references) and, when grad is enabled, routes the outputs through ``_Regather``, whose
backward gathers the unit again before the unit's own backward runs (and prefetches the unit
before it). A unit is released in backward once every param it owns has accumulated its
gradient; whatever is still held (e.g. a param that got no gradient) is released by
``after_backward``. Groups are reference-counted, so a group two active units share stays.

**Ordering.** gloo and NCCL need every rank of a group to issue its collectives in the same
order. The gathers run on their own copies of the world and EDP groups (``gather_groups``),
so they never interleave with gradient reduce-scatters, which depend on when gradients
arrive. Dense units are gathered and released at the same points on every rank (every rank
runs the same modules and gets the same dense gradients); expert units only hold expert
groups, which nothing else gathers.
Reference counterpart: none. The reference's sharded step (``reference/zero.py``) ends with the
all-gather; stage 3 only moves that gather to the next use, which changes no number (stage 3
is tested bit-identical to stage 2, tests/torch_impl/test_stage3.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from moezero.distributed.topology import Topology, gather_groups
from moezero.model.moe import MoE, expert_tag

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(eq=False)
class _Unit:
    """One module's params of one data-parallel kind and the groups they need."""

    name: str
    fqns: frozenset[str]
    slots: tuple[int, ...]  # indices into ZeroOptimizer.slots, ascending
    pending: int = 0  # backward: owned params whose gradient has not arrived yet
    active: bool = False  # held for backward


@dataclass(eq=False)
class _Gathering:
    work: object
    buffer: torch.Tensor


@dataclass(eq=False)
class _State:
    refs: list[int]
    resident: set[int] = field(default_factory=set)
    inflight: dict[int, _Gathering] = field(default_factory=dict)


def unit_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every gather unit in registration (~forward) order; root first."""
    lists = {n for n, m in model.named_modules() if n and isinstance(m, nn.ModuleList)}
    return [(name, module) for name, module in model.named_modules()
            if module is model or name.rpartition(".")[0] in lists or isinstance(module, MoE)]


class ParamGatherer:
    """Gathers and releases a stage-3 model's params around each unit's forward and backward."""

    def __init__(self, zero, model: nn.Module, topology: Topology, *, prefetch: bool = True):
        self.zero, self.prefetch = zero, prefetch
        self.groups = gather_groups(topology)
        self.state = _State([0] * len(zero.slots))
        self.by_module = self._build_units(model)
        self.order = [u for units in self.by_module.values() for u in units]
        self.owner = {fqn: u for u in self.order for fqn in u.fqns}
        for name, module in unit_modules(model):
            units = self.by_module[name]
            module.register_forward_pre_hook(lambda m, a, units=units: self._pre_forward(units))
            module.register_forward_hook(lambda m, a, out, units=units: self._post_forward(units, out))
        for fqn, p in zero.params.items():
            p.register_post_accumulate_grad_hook(lambda _p, fqn=fqn: self._on_grad(fqn))
        for p in zero.params.values():
            p.data.untyped_storage().resize_(0)

    # ------------------------------------------------------------------ units
    def _build_units(self, model: nn.Module) -> dict[str, list[_Unit]]:
        names = [name for name, _ in unit_modules(model)]
        owned: dict[tuple[str, str], set[str]] = {}
        for fqn, p in model.named_parameters():
            unit = max((n for n in names if not n or fqn.startswith(n + ".")), key=len)
            tag = expert_tag(p)
            kind = "dense" if tag is None else f"moe/{tag.group_name}/ep{tag.ep_size}"
            owned.setdefault((unit, kind), set()).add(fqn)
        slots_of: dict[str, set[int]] = {}
        for i, slot in enumerate(self.zero.slots):
            for member in slot.group.members:
                slots_of.setdefault(member.fqn, set()).add(i)
        by_module: dict[str, list[_Unit]] = {n: [] for n in names}
        for (unit, kind), fqns in sorted(owned.items(), key=lambda kv: names.index(kv[0][0])):
            label = f"{unit or '<root>'}[{kind}]"
            by_module[unit].append(_Unit(label, frozenset(fqns), self._closure(fqns, slots_of)))
        return by_module

    def _closure(self, fqns: set[str], slots_of: dict[str, set[int]]) -> tuple[int, ...]:
        """The groups holding ``fqns``, plus the groups of every member of those groups."""
        need, todo = set(), set().union(*(slots_of[f] for f in fqns))
        while todo:
            i = todo.pop()
            need.add(i)
            for member in self.zero.slots[i].group.members:
                todo |= slots_of[member.fqn] - need
        return tuple(sorted(need))

    # ------------------------------------------------------------------ hooks
    def _pre_forward(self, units: list[_Unit]) -> None:
        for unit in units:
            self._acquire(unit)
        if self.prefetch:
            after = self.order.index(units[-1]) + 1 if units else len(self.order)
            for unit in self.order[after:after + 1]:
                self._start(unit.slots)

    def _post_forward(self, units: list[_Unit], out):
        for unit in units:
            self._release(unit)
        if not torch.is_grad_enabled() or not units:
            return out
        tensors = [t for t in _flatten(out) if t.requires_grad]
        if not tensors:
            return out
        wrapped = iter(_Regather.apply(self, units, *tensors))
        swap = {id(t): next(wrapped) for t in tensors}
        return _rebuild(out, swap)

    def _pre_backward(self, units: list[_Unit]) -> None:
        for unit in units:
            self._acquire(unit)
            unit.pending, unit.active = len(unit.fqns), True
        if self.prefetch:
            before = self.order.index(units[0]) - 1
            if before >= 0:
                self._start(self.order[before].slots)

    def _on_grad(self, fqn: str) -> None:
        unit = self.owner[fqn]
        if unit.active:
            unit.pending -= 1
            if unit.pending == 0:
                unit.active = False
                self._release(unit)

    def after_backward(self) -> None:
        """Release units still held for backward and drop unused prefetches."""
        for unit in self.order:
            if unit.active:
                unit.active = False
                self._release(unit)
        self.drain()

    def drain(self) -> None:
        """Wait for gathers in flight and drop them (their buffers are freed)."""
        for gathering in self.state.inflight.values():
            if gathering.work is not None:
                gathering.work.wait()
        self.state.inflight.clear()

    # ------------------------------------------------------------------ groups
    def _acquire(self, unit: _Unit) -> None:
        st = self.state
        for i in unit.slots:
            st.refs[i] += 1
        self._start(unit.slots)
        for i in unit.slots:
            if i not in st.resident:
                self._scatter(i, st.inflight.pop(i))

    def _release(self, unit: _Unit) -> None:
        st = self.state
        for i in unit.slots:
            st.refs[i] -= 1
            if st.refs[i] == 0 and i in st.resident:
                st.resident.discard(i)
                for member in self.zero.slots[i].group.members:
                    storage = self.zero.params[member.fqn].data.untyped_storage()
                    if storage.nbytes():
                        storage.resize_(0)

    def _start(self, slots: tuple[int, ...]) -> None:
        """Launch the all-gather of every listed group neither resident nor in flight."""
        st = self.state
        for i in slots:
            if i in st.resident or i in st.inflight:
                continue
            slot = self.zero.slots[i]
            shard = self.zero.param_shard(slot)
            part = slot.group.partition
            if part.dp_size == 1:
                st.inflight[i] = _Gathering(None, shard)
                continue
            buffer = shard.new_empty(part.padded_numel)
            work = _all_gather(buffer, shard, group=self.groups[slot.channel], async_op=True)
            st.inflight[i] = _Gathering(work, buffer)

    def _scatter(self, i: int, gathering: _Gathering) -> None:
        """Wait for group ``i``'s gather and copy it into its members' (re-allocated) storage."""
        if gathering.work is not None:
            gathering.work.wait()
        with torch.no_grad():
            for member, off in self.zero.slots[i].group.partition.offsets:
                param = self.zero.params[member.fqn].data
                storage = param.untyped_storage()
                if storage.nbytes() == 0:
                    storage.resize_(param.numel() * param.element_size())
                param.view(-1)[member.start:member.stop].copy_(
                    gathering.buffer[off:off + member.numel])
        self.state.resident.add(i)


class _Regather(torch.autograd.Function):
    """Identity on a unit's outputs whose backward gathers the unit's params again."""

    @staticmethod
    def forward(ctx, gatherer: ParamGatherer, units: list[_Unit], *xs):
        ctx.gatherer, ctx.units = gatherer, units
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.gatherer._pre_backward(ctx.units)
        return (None, None, *grads)


def _flatten(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in _flatten(item)]
    return []


def _rebuild(out, swap: dict[int, torch.Tensor]):
    if isinstance(out, torch.Tensor):
        return swap.get(id(out), out)
    if isinstance(out, (tuple, list)):
        return type(out)(_rebuild(item, swap) for item in out)
    return out
