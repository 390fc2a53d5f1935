"""The autograd identities the stage-3 gatherer (``moezero.zero.gather.ParamGatherer``) puts
around a unit: ``UnitHook`` on its outputs (their gradient arriving means backward reaches the
unit: gather its params again) and on its inputs (their gradient computed means
the unit's backward is over: its frozen params may go), and the helpers that find and replace
the tensors of a module's output."""

from __future__ import annotations

import torch


class UnitHook(torch.autograd.Function):
    """Identity on a unit's tensors whose backward calls ``on_backward()`` first: on its outputs
    the gatherer's ``_pre_backward`` (gather the params again), on its inputs its
    ``_on_inputs_done`` (the unit's backward is over: its frozen params may go)."""

    @staticmethod
    def forward(ctx, on_backward, *xs):
        ctx.on_backward = on_backward
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.on_backward()
        return (None, *grads)


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
