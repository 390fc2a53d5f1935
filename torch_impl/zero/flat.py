"""Flat parameter buffers shared by the optimizers (not the model's buffers:
``moezero.plan.model_buffers``): local groups sorted into data-parallel *kinds*, and
each kind's parameters (and, where full gradients are kept, their gradients) as one flat buffer
that the parameters view.

A kind is the dense params (one process group: the world) or one moe group's experts of this
rank's EP rank (its EDP group). A kind's buffer holds its optimizer groups back to back in plan
order, each group's members contiguous in member order (``Partition.offsets``) and *without*
partition padding. The chunks of one logical group are consecutive in plan order and of one
kind, so a parameter that ``moe.max_group_size`` slices across groups stays one contiguous
view. Padding lives only in the communication buffers and in the partitions. Frozen groups
(``train.freeze``) form kinds of their own (``frozen/dense``, ``frozen/moe/...``) that have no
gradient buffer.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

import torch
from torch import nn

from moezero.distributed.topology import Topology
from moezero.plan.partition import Partition
from moezero.zero.buckets import GroupColumns
from moezero.zero.groups import LocalGroup
from moezero.zero.shards import Kind, MemoryMeter, Slot

Where = dict[str, tuple[int, int]]  # fqn -> (kind index, flat position of its element 0)


def build_kinds(local: Sequence[LocalGroup], topology: Topology,
                columns: Callable[[Partition], GroupColumns]) -> list[Kind]:
    """The local groups by kind, each a ``Slot`` with its offset in the kind's buffer."""
    kinds: dict[str, Kind] = {}
    cursor: dict[str, int] = defaultdict(int)
    for g in local:
        plan, part = g.plan, g.partition
        name = "dense" if not plan.is_expert else f"moe/{plan.moe_group}/ep{plan.ep_rank}"
        name = f"frozen/{name}" if plan.frozen else name
        if name not in kinds:
            group = topology.edp_group(plan.ep_size) if plan.is_expert else None
            channel = f"edp{plan.ep_size}" if plan.is_expert else "world"
            kinds[name] = Kind(name, part.dp_size, group, channel, [], frozen=plan.frozen)
        kinds[name].slots.append(Slot(g, cursor[name], part.dp_rank(topology.rank),
                                      columns(part), channel=kinds[name].channel))
        cursor[name] += part.numel
    return list(kinds.values())


def param_positions(kinds: Sequence[Kind], fqns) -> Where:
    """Where each parameter's element 0 lies in its kind's flat buffer; AssertionError when a
    parameter's pieces are not contiguous or a parameter is in no local group."""
    where: Where = {}
    for k, kind in enumerate(kinds):
        first: dict[str, int] = {}
        for slot in kind.slots:
            for member, off in slot.partition.offsets:
                pos = slot.offset + off - member.start
                if first.setdefault(member.fqn, pos) != pos:
                    raise AssertionError(f"{member.fqn}: pieces are not contiguous in {kind.name}")
        where.update((fqn, (k, pos)) for fqn, pos in first.items())
    if set(where) != set(fqns):
        missing = sorted(set(fqns) - set(where))[:3]
        raise AssertionError(f"params outside this rank's optimizer groups: {missing}")
    return where


def flatten_params(kinds: Sequence[Kind], params: dict[str, nn.Parameter], where: Where, *,
                   full_grads: bool, meter: MemoryMeter) -> None:
    """Copy each kind's params into one flat buffer and make them views of it; with
    ``full_grads`` also allocate a zeroed flat gradient buffer per kind (``attach_grad_views``)."""
    p0 = next(iter(params.values()))
    for k, kind in enumerate(kinds):
        numel = sum(s.numel for s in kind.slots)
        kind.params = torch.empty(numel, dtype=p0.dtype, device=p0.device)
        for fqn, p in params.items():
            kk, pos = where[fqn]
            if kk == k:
                view = kind.params[pos:pos + p.numel()].view_as(p)
                view.copy_(p.detach())
                p.data = view
        if full_grads and not kind.frozen:
            kind.grads = torch.zeros_like(kind.params)
            meter.add_persistent(kind.grads)


def attach_grad_views(params: dict[str, nn.Parameter], kinds: Sequence[Kind],
                      where: Where) -> None:
    """Point every gradient-less ``param.grad`` at its range of its kind's flat gradients, so
    autograd accumulates micro-batches there in place (frozen parameters have none)."""
    for fqn, p in params.items():
        if p.grad is None and p.requires_grad:
            k, pos = where[fqn]
            p.grad = kinds[k].grads[pos:pos + p.numel()].view_as(p)
