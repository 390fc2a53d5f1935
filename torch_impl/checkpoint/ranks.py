"""The coordination of a checkpoint across ranks: a dedicated gloo process group that carries
JSON only (header status, range records, per-rank state, the commit's outcome), so every rank
raises the same one-line ``CheckpointError`` when any rank fails. Used by
``moezero.checkpoint.save`` and ``moezero.checkpoint.load``."""

from __future__ import annotations

import json
import logging

import torch
import torch.distributed as dist

from moezero.plan.store import CheckpointError

log = logging.getLogger("moezero.checkpoint")


class CheckpointGroup:
    """JSON collectives over a gloo group of every rank. Create it on every rank, in the same
    order as the other groups (``new_group`` is collective)."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.group = dist.new_group(backend="gloo") if world_size > 1 else None

    def all_gather(self, obj) -> list:
        """Every rank's JSON-able ``obj`` in rank order (JSON bytes over gloo, no pickle)."""
        if self.world_size == 1:
            return [obj]
        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self.group)
        cap = max(int(s) for s in sizes)
        buf = torch.zeros(cap, dtype=torch.uint8)
        buf[:data.numel()] = data
        out = [torch.empty(cap, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(out, buf, group=self.group)
        return [json.loads(bytes(o[:int(s)].numpy())) for o, s in zip(out, sizes, strict=True)]

    def agree(self, error: str | None, what: str) -> None:
        """Raise the first rank's error on every rank (collective), or return if none failed."""
        errors = [e for e in self.all_gather(error) if e]
        if errors:
            raise CheckpointError(f"{what}: {errors[0]}")


def one_line(exc: BaseException) -> str:
    """An exception as one line (its type named unless it is a checkpoint or OS error; an OS
    error that names its file as ``<path>: <cause>``)."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if isinstance(exc, (CheckpointError, OSError)) else f"{type(exc).__name__}: {text}"


def failure(exc: Exception, rank: int) -> str:
    """``rank R: <one line>``: the error a rank brings to the agreement of a save, which
    catches every exception so that no rank is left waiting in a collective. An exception
    other than an OS or checkpoint error is a bug, not bad input: its traceback is logged
    (``moezero.checkpoint``; stderr unless logging is configured) before it becomes a line."""
    if not isinstance(exc, (OSError, CheckpointError)):
        log.error("rank %d: unexpected error during a checkpoint save", rank, exc_info=exc)
    return f"rank {rank}: {one_line(exc)}"
