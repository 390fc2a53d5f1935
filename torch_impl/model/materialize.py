"""Sharded construction: a model built on the meta device, given storage only where it is kept.

``moezero.model.decoder.init_weights`` draws every parameter from a generator seeded by the
run seed and the parameter's FQN, so one parameter's initial value can be made alone, without
the rest of the model. ``KeyedInit`` does exactly that (it runs ``init_weights`` itself on a
one-parameter view, so the values stay bit-identical whatever that rule becomes), and
``materialize`` gives a meta-device model its storage:

- ``values=True`` (ZeRO stages 0-2, where every rank keeps its EP-local experts and the
  replicated dense params): each parameter is allocated on the device in the compute dtype
  and filled, one parameter's fp32 value alive at a time;
- ``values=False`` (stage 3): each parameter gets an empty storage (its shape, no bytes); the
  optimizer fills its shards from ``KeyedInit.source`` (FQN -> value), which keeps only the
  last parameter it made, so the working set is one parameter, never the model.

Buffers (the router's expert bias and load counts) are small and whole on every rank at every
stage: each meta buffer is allocated on the device in its own dtype and filled by its module's
``reset_buffers()``, the initial values the module's constructor gives them (the engine's
``model.to`` then casts them as it casts a built model's).

Offloaded state is written shard by shard by the optimizer as it is built (docs/scale.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from moezero.model.decoder import init_weights
from moezero.model.meta import on_meta


@dataclass(frozen=True)
class KeyedInit:
    """The deterministic FQN-keyed init of ``init_weights`` (``seed``, ``std``) for a model
    whose ``args`` (``ModelArgs`` or None) set the output-projection scale."""

    seed: int
    std: float = 0.02
    args: object = None

    def value(self, fqn: str, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        """``fqn``'s initial value: fp32 on the host, as ``init_weights`` writes it."""
        out = torch.empty(shape, dtype=torch.float32)
        init_weights(_OneParam(self.args, fqn, out), self.seed, self.std)
        return out

    def source(self, shapes: dict[str, torch.Size], dtype: torch.dtype,
               device: torch.device) -> Callable[[str], torch.Tensor]:
        """FQN -> initial value in ``dtype`` on ``device``, caching the last one made
        (consecutive optimizer groups continue a sliced parameter)."""
        last: dict[str, torch.Tensor] = {}

        def value_of(fqn: str) -> torch.Tensor:
            if fqn not in last:
                last.clear()
                last[fqn] = self.value(fqn, shapes[fqn]).to(device=device, dtype=dtype)
            return last[fqn]

        return value_of


class _OneParam:
    """What ``init_weights`` reads of a model (``args``, ``named_parameters``), for one param."""

    def __init__(self, args, fqn: str, tensor: torch.Tensor):
        self.args, self._item = args, (fqn, tensor)

    def named_parameters(self):
        yield self._item


def meta_model(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` on the meta device: shapes and FQNs, no storage, no init (``on_meta``)."""
    with on_meta():
        return build()


def materialize(model: nn.Module, init: KeyedInit, *, device: torch.device, dtype: torch.dtype,
                values: bool) -> None:
    """Replace each meta parameter by one on ``device`` in ``dtype`` (its attributes, e.g. the
    expert tag, kept): filled from ``init`` when ``values``, else with an empty storage; and
    each meta buffer by its initial value on ``device`` (``reset_buffers``), whatever ``values``.

    Raises:
        ValueError: a module holds a meta buffer but has no ``reset_buffers`` to fill it.
    """
    made: dict[int, nn.Parameter] = {}
    for module_name, module in model.named_modules():
        _reset_buffers(module, module_name, device)
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in made:
                fqn = f"{module_name}.{name}" if module_name else name
                made[id(param)] = _make(param, fqn, init, device, dtype, values)
            module._parameters[name] = made[id(param)]


def _reset_buffers(module: nn.Module, module_name: str, device: torch.device) -> None:
    """Give ``module``'s meta buffers storage on ``device`` (their dtype kept) and their initial
    values from the module's ``reset_buffers``."""
    meta = [name for name, b in module._buffers.items() if b is not None and b.is_meta]
    if not meta:
        return
    if not callable(getattr(module, "reset_buffers", None)):
        fqn = f"{module_name}.{meta[0]}" if module_name else meta[0]
        raise ValueError(f"materialize: buffer {fqn} is on the meta device and "
                         f"{type(module).__name__} has no reset_buffers() to give it its "
                         "initial value")
    for name in meta:
        module._buffers[name] = torch.empty_like(module._buffers[name], device=device)
    module.reset_buffers()


def _make(param: nn.Parameter, fqn: str, init: KeyedInit, device: torch.device,
          dtype: torch.dtype, values: bool) -> nn.Parameter:
    data = torch.empty(param.shape, dtype=dtype, device=device)
    if values:
        with torch.no_grad():
            data.copy_(init.value(fqn, param.shape))
    else:
        data.untyped_storage().resize_(0)
    new = nn.Parameter(data, requires_grad=param.requires_grad)
    new.__dict__.update(param.__dict__)
    return new
