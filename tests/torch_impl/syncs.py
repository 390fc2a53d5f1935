"""Count the host synchronisations a piece of torch code would cost on a GPU, on any device.

A CUDA kernel runs behind the host; an op whose *result size or value* the host needs waits
for the device (a "sync"). On CPU nothing waits, so ``HostSyncs`` recognises the ops that
would: Python-level reads of tensor values (``tolist``, ``cpu``, ``numpy``, caught by a
``TorchFunctionMode``), and aten ops whose output shape or a host value depends on tensor
data (``_local_scalar_dense`` behind ``item``/``int``/``bool``, ``nonzero``, boolean-mask
indexing, ``masked_select``, ``bincount``, ``unique``, ``repeat_interleave`` without
``output_size``, ...; caught by a ``TorchDispatchMode``, which also sees autograd's backward
ops when the backward runs inside the context). ``torch.cuda.set_sync_debug_mode`` is the
GPU-side check (tests marked ``gpu``).

Usage::

    with HostSyncs() as syncs:
        out = layer(x)
    assert syncs.count == 0, syncs.events
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# Tensor methods that hand tensor data to the host (no aten op on a CPU tensor).
_HOST_READS = {"tolist", "cpu", "numpy", "__array__"}
# aten ops that need a device value on the host (output size or a Python scalar).
_DATA_DEPENDENT = {"_local_scalar_dense", "nonzero", "nonzero_numpy", "masked_select",
                   "bincount", "_unique", "_unique2", "unique_dim", "unique_consecutive",
                   "equal", "is_nonzero", "argwhere"}
_BOOL_INDEXED = {"index", "index_put", "index_put_", "_index_put_impl_"}


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in (indices or ()))


def sync_reason(func, args, kwargs) -> str | None:
    """Why an aten op would sync the host on a GPU, or None."""
    name = func.overloadpacket.__name__
    if name in _DATA_DEPENDENT:
        return name
    if name in _BOOL_INDEXED and _has_bool_index(args):
        return f"{name} with a boolean mask"
    if func is torch.ops.aten.repeat_interleave.Tensor and (kwargs or {}).get("output_size") is None:
        return "repeat_interleave without output_size"  # the kernel sums the repeats on the host
    return None


class _Functions(TorchFunctionMode):
    def __init__(self, events: list[str]):
        super().__init__()
        self.events = events

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _HOST_READS:
            self.events.append(name)
        return func(*args, **(kwargs or {}))


class _Ops(TorchDispatchMode):
    def __init__(self, events: list[str]):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        reason = sync_reason(func, args, kwargs)
        if reason is not None:
            self.events.append(reason)
        return func(*args, **(kwargs or {}))


class HostSyncs:
    """Context manager recording every would-be host sync; ``count`` and ``events`` after."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self._modes = (_Functions(self.events), _Ops(self.events))

    @property
    def count(self) -> int:
        return len(self.events)

    def __enter__(self) -> HostSyncs:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
