"""What autograd keeps for backward: the distinct non-parameter storages saved by the ops run
inside ``saved_storages(model)`` (tests of activation memory: estimate and recomputation)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def saved_storages(model: nn.Module) -> Iterator[dict[int, int]]:
    """Yields ``{storage address: bytes}`` of every storage autograd saves inside the block,
    each once, ``model``'s parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield kept
