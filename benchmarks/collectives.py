"""Count the collectives a rank issues: ``torch.distributed``'s functions (and every ``moezero``
module attribute bound to one of them) wrapped for the duration of a ``with`` block. A
collective implemented by another one counts once. Used by ``benchmarks.moezero_trainer`` for
the ``collectives`` series (collectives per step against optimizer groups) and by
tests/torch_impl/test_zero_comm.py."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections import Counter

import torch.distributed as dist

NAMES = ("all_reduce", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
         "reduce_scatter_tensor", "all_to_all_single", "broadcast", "all_gather", "barrier")


def op_of(name: str) -> str:
    """The operation a function name performs (the tensor and list forms together)."""
    if "gather" in name:
        return "all-gather"
    if "reduce_scatter" in name:
        return "reduce-scatter"
    return name.replace("_single", "").replace("_", "-")


@contextlib.contextmanager
def counting():
    """Yield a ``Counter`` of (function name, first tensor's dtype) -> calls made inside the
    block on this rank."""
    counts: Counter = Counter()
    state = threading.local()
    patched = []

    def wrap(name, fn):
        def counted(tensor=None, *args, **kwargs):
            outer = getattr(state, "inside", False)
            if not outer:
                counts[(name, str(getattr(tensor, "dtype", "")).removeprefix("torch."))] += 1
            state.inside = True
            try:
                return fn(tensor, *args, **kwargs)
            finally:
                state.inside = outer
        return counted

    owners = [dist] + [m for n, m in list(sys.modules.items()) if n.startswith("moezero") and m]
    for name in NAMES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        wrapped = wrap(name, fn)
        for owner in owners:
            for attr, value in list(vars(owner).items()):
                if value is fn:
                    patched.append((owner, attr, value))
                    setattr(owner, attr, wrapped)
    try:
        yield counts
    finally:
        for owner, attr, value in reversed(patched):
            setattr(owner, attr, value)


def by_op(counts: Counter) -> dict[str, int]:
    """Calls per operation (``op_of``), whatever the dtype."""
    out: Counter = Counter()
    for (name, _), n in counts.items():
        out[op_of(name)] += n
    return dict(out)
