"""Refuse, before any rank starts, a micro-batch whose activations cannot fit in memory.

A ``train.seq_len`` or ``train.micro_batch_size`` off by orders of magnitude (``1e8``) is valid
to the schema; the ranks then build data and models and die of a memory error (after a first
step that may run for many minutes). The activations one micro-batch keeps for backward grow
linearly with both and are estimated exactly (``moezero.transients.activation_bytes``), so the
CLI compares them with the memory a rank can have at most: its device's (CUDA) or its share of
the host's RAM (CPU). Only a micro-batch that cannot fit at all is refused; the full estimate
is ``moezero estimate``.
"""

from __future__ import annotations

import os

from moezero.config import Config
from moezero.config.errors import ConfigError
from moezero.transients import activation_bytes

__all__ = ["check_activation_memory", "memory_of"]

_GIB = 1 << 30


def memory_of(device: str) -> int | None:
    """Bytes of memory of one compute device: CUDA device 0's, or the host's RAM; None when
    unknown."""
    if device == "cuda":
        import torch

        return torch.cuda.get_device_properties(0).total_memory
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_activation_memory(cfg: Config, *, device: str, memory_bytes: int | None,
                            local_ranks: int) -> None:
    """One-line ``ConfigError`` when one micro-batch's activations (in the compute dtype;
    ``auto`` counted as bf16 on CUDA, its smallest) exceed the memory one rank can have:
    ``memory_bytes`` of its device, or on the host that divided among ``local_ranks``."""
    if memory_bytes is None:
        return
    dtype = cfg.precision.resolve(cuda=device == "cuda", bf16_supported=True)
    itemsize = 4 if dtype == "fp32" else 2
    need = activation_bytes(cfg, itemsize)
    have = memory_bytes if device == "cuda" else memory_bytes // max(1, local_ranks)
    if need <= have:
        return
    where = "device memory of a CUDA device" if device == "cuda" else "host memory per rank"
    raise ConfigError(
        "train.micro_batch_size × train.seq_len",
        f"one micro-batch of {cfg.train.micro_batch_size} × {cfg.train.seq_len} tokens needs "
        f"about {need / _GIB:,.1f} GiB of activations per rank, more than the "
        f"{have / _GIB:,.1f} GiB of {where}; lower micro_batch_size or seq_len, or turn on "
        "activation_checkpointing", "checked before any rank starts")
