"""Checkpointed buffers of a model (``moezero.plan.model_buffers``: the routers' expert biases).

They are replicated, identical on every rank, and in no optimizer group: rank 0 writes them
whole into the layout's ``buffers.safetensors`` (``plan.model_buffer_io.write_buffers``); every
rank reads them back on load. Reference counterpart: ``reference/checkpoint.py`` (the same file, the
biases in its params tree).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from moezero.plan import store
from moezero.plan.model_buffers import is_buffer

__all__ = ["buffer_shapes", "buffer_targets", "buffer_values", "read_buffers"]


def buffer_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """``{fqn: shape}`` of the model's checkpointed buffers."""
    return {fqn: tuple(b.shape) for fqn, b in model.named_buffers() if is_buffer(fqn)}


def buffer_values(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """``{fqn: fp32 host copy}`` of the model's checkpointed buffers (taken at the step
    boundary, so a background save writes this step's values)."""
    return {fqn: b.detach().float().cpu().numpy().copy() for fqn, b in model.named_buffers()
            if is_buffer(fqn)}


def buffer_targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{fqn: buffer}`` of the model's checkpointed buffers, for a load to fill."""
    return {fqn: b for fqn, b in model.named_buffers() if is_buffer(fqn)}


@torch.no_grad()
def read_buffers(targets: dict[str, torch.Tensor], where: Path, manifest, reader=None) -> None:
    """Each target buffer from the checkpoint, or zero (its initial value, e.g. the expert
    bias of an imported model) where the checkpoint has none. Check the shapes first
    (``plan.model_buffer_io.check_buffers``); ``reader`` verifies what it reads
    (``plan.checked.CheckedReader``)."""
    saved = dict(manifest.layout.buffers)
    for fqn, buf in targets.items():
        if fqn not in saved:
            buf.zero_()
            continue
        value = store.read_param(where, manifest, fqn, reader=reader).reshape(buf.shape)
        buf.copy_(torch.from_numpy(value))
