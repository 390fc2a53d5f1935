"""The autograd identities the stage-3 gatherer (``moezero.zero.gather.ParamGatherer``) puts
around a unit: ``Regather`` on its outputs (their gradient arriving means backward reaches the
unit: gather its params again) and ``InputsDone`` on its inputs (their gradient computed means
the unit's backward is over: its frozen params may go), and the helpers that find and replace
the tensors of a module's output."""

from __future__ import annotations

import torch


class Regather(torch.autograd.Function):
    """Identity on a unit's outputs whose backward gathers the unit's params again."""

    @staticmethod
    def forward(ctx, gatherer, units: list[int], *xs):
        ctx.gatherer, ctx.units = gatherer, units
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.gatherer._pre_backward(ctx.units)
        return (None, None, *grads)


class InputsDone(torch.autograd.Function):
    """Identity on a unit's inputs whose backward (the unit's last) lets the unit go."""

    @staticmethod
    def forward(ctx, gatherer, units: list[int], *xs):
        ctx.gatherer, ctx.units = gatherer, units
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.gatherer._on_inputs_done(ctx.units)
        return (None, None, *grads)


def flatten(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in flatten(item)]
    return []


def rebuild(out, swap: dict[int, torch.Tensor]):
    if isinstance(out, torch.Tensor):
        return swap.get(id(out), out)
    if isinstance(out, (tuple, list)):
        return type(out)(rebuild(item, swap) for item in out)
    return out
