"""Activation checkpointing: decoder blocks recomputed in backward instead of keeping their
activations (``activation_checkpointing: {enabled, every_n_layers}``).

``checkpoint_blocks`` wraps the forward of every ``every_n_layers``-th module of the model's
``nn.ModuleList``s (the decoder's blocks) in ``torch.utils.checkpoint.checkpoint`` with
``use_reentrant=False``, from outside the block: the module keeps its class, FQNs and hooks
(stage-3 gathers, telemetry), which still run around the call; in backward the block's forward
runs again (its submodules' hooks too: a MoE layer regathers its experts and repeats its EP
all-to-all, every rank in the same order). Recomputation repeats the same ops on the same
inputs, so results are bit-identical on a deterministic device (tested on CPU fp32).
``recomputing()`` tells forward hooks that count things (``moezero.telemetry``) to skip the
second pass, and the stage-3 gatherer (``moezero.zero.gather``) not to prefetch or wrap outputs
while it runs.

**Whole recomputation** (``early_stop=False``). torch's non-reentrant checkpoint by default
stops the recomputed forward (by raising inside a saved-tensor hook) as soon as it has
rebuilt the last tensor the backward needs. The rest of the block's forward, its submodules'
forward hooks included, then never runs: a stage-3 MoE layer's gather pre-hook had acquired its
groups and its release hook never came, so the groups stayed resident and the next step's
forward read the pre-step params (losses differed from step 2). Recomputing the whole block
keeps every pre-hook paired with its hook, at the cost of the few ops after the last saved
tensor.
"""

from __future__ import annotations

import contextlib
import functools
from contextvars import ContextVar

from torch import nn
from torch.utils.checkpoint import checkpoint

_RECOMPUTING: ContextVar[bool] = ContextVar("moezero_recomputing", default=False)


def recomputing() -> bool:
    """True while a checkpointed block's forward runs again in backward."""
    return _RECOMPUTING.get()


@contextlib.contextmanager
def _recompute_pass():
    token = _RECOMPUTING.set(True)
    try:
        yield
    finally:
        _RECOMPUTING.reset(token)


def _contexts():
    return contextlib.nullcontext(), _recompute_pass()


def checkpoint_blocks(model: nn.Module, every_n_layers: int = 1) -> list[str]:
    """Checkpoint every ``every_n_layers``-th block (0, n, 2n, ...) of each ``nn.ModuleList``
    of ``model``; returns the names of the wrapped blocks."""
    if every_n_layers < 1:
        raise ValueError(f"activation_checkpointing.every_n_layers: must be >= 1, got {every_n_layers}")
    wrapped = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList):
            continue
        for i, block in enumerate(module):
            if i % every_n_layers == 0:
                block.forward = functools.partial(_checkpointed, block.forward)
                wrapped.append(f"{name}.{i}" if name else str(i))
    return wrapped


def _checkpointed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, context_fn=_contexts,
                      early_stop=False, **kwargs)
