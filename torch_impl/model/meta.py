"""Building modules on the meta device without running their initialisers.

A module built under ``torch.device("meta")`` still runs its ``reset_parameters``; on meta
tensors some of those fills (``normal_`` of ``nn.Embedding``, ``trunc_normal_``'s ``erfinv_``
and ``clamp_``) are torch's Python reference kernels, whose first call imports
``torch._dynamo`` and, with it, sympy and some 800 modules: about 70 MiB of anonymous memory
in every rank (BENCHMARKS.md, "Where the main table's memory goes"), for values a meta tensor
does not hold. ``on_meta`` builds on the meta device and skips those fills: shapes, dtypes,
FQNs and ``requires_grad`` are the same, and the values are made later (``materialize``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

_INIT_FILLS = frozenset(getattr(nn.init, name) for name in dir(nn.init)
                        if name.endswith("_") and not name.startswith("_"))
"""``torch.nn.init``'s in-place initialisers (``normal_``, ``kaiming_uniform_``, ...)."""
_VALUE_FILLS = frozenset(getattr(torch.Tensor, name) for name in (
    "normal_", "uniform_", "fill_", "zero_", "exponential_", "erfinv_", "clamp_", "mul_",
    "add_", "copy_"))
"""In-place tensor methods that change values only (never shape, dtype or flags): what the
initialisers above and modules' own ``reset_parameters`` call."""


class _SkipFills(TorchFunctionMode):
    """Returns a meta tensor unchanged from a value fill; everything else runs as usual."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # nn.init's functions pass their tensor by keyword to __torch_function__
        target = args[0] if args else kwargs.get("tensor")
        if ((func in _INIT_FILLS or func in _VALUE_FILLS)
                and isinstance(target, torch.Tensor) and target.is_meta):
            return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Modules built inside are on the meta device, their initialisers' fills skipped."""
    with torch.device("meta"), _SkipFills():
        yield
