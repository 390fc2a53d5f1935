"""Frozen params read where they lie: a LoRA run's base weights from the base checkpoint's own
files, never copied to swap files (stage 3, ``offload_param.device: nvme``; docs/finetune.md,
"The base read where it lies").

The import's layout puts a group's tensors in one file in group order (natural FQN order, so
each block's dense params lie together), so a rank's shard of a frozen group whose members are
consecutive members of one of the base's groups is one contiguous byte range of that file: the
base's own grouping, or a finer one such as ``moe.split_dense_by_layer``'s one group per block
read from an import with one dense group. ``plan_sources`` maps each such frozen slot to that
range (``BaseSource``); ``offload.state.SwapState`` reads those slots from there through the same
I/O engine, read-ahead and buffers as its swap files, and writes them nowhere. The base's
checksums are verified once, when the run loads it (``checkpoint.load``); the identity of every
file read (size, mtime, inode: ``FileIdentity``) is recorded when the sources are planned and
checked before each read, so a base changed during the run is refused in one line rather than
read. A bf16 or fp16 base under fp32 compute (the CPU) is upcast per shard as it arrives, before
its unit's all-gather. Reference counterpart: none (the reference keeps every state in memory).
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from moezero.offload.aio import ALIGN, AsyncIO, aligned_empty
from moezero.offload.options import IOOptions
from moezero.plan import partition_group, store
from moezero.plan.store import CheckpointError

TORCH_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


@dataclass(frozen=True)
class FileIdentity:
    """What identifies a file's contents between two reads without reading them."""

    size: int
    mtime_ns: int
    inode: int

    @classmethod
    def of(cls, path: Path) -> FileIdentity:
        st = os.stat(path)
        return cls(st.st_size, st.st_mtime_ns, st.st_ino)


@dataclass(frozen=True)
class BaseSource:
    """A frozen slot's real elements (``numel`` of dtype ``dtype``) at ``offset`` of ``path``."""

    path: Path
    offset: int
    numel: int
    dtype: torch.dtype
    identity: FileIdentity

    def check(self) -> None:
        """CheckpointError (one line) when the file is gone or not the one recorded."""
        try:
            now = FileIdentity.of(self.path)
        except OSError as exc:
            raise CheckpointError(f"{self.path}: the base checkpoint's file cannot be read "
                                  f"during the run ({exc.strerror or exc})") from None
        if now != self.identity:
            raise CheckpointError(f"{self.path}: the base checkpoint's file changed during the "
                                  f"run (size, mtime or inode differ from the start: {now} "
                                  f"vs {self.identity}); refusing to read it")


class BaseFiles:
    """The frozen slots read from a base checkpoint (``slot in files``) and the I/O engine
    that reads them, opening the base's files read-only; empty: none."""

    def __init__(self, sources: dict | None = None, io: AsyncIO | None = None):
        self.sources, self.io = sources or {}, io

    def __contains__(self, slot) -> bool:
        return slot in self.sources

    def read(self, slot, buf: torch.Tensor) -> Future:
        """Start filling ``buf`` with ``slot``'s shard (``read_source``)."""
        return read_source(self.io, self.sources[slot], buf)

    def close(self) -> None:
        if self.io is not None:
            self.io.close()


def plan_sources(base: str | os.PathLike, slots, options: IOOptions) -> BaseFiles:
    """The frozen slots whose members the base checkpoint (a step directory) holds
    consecutively in one group (under any name: an import's ``dense/decay/0`` holds a LoRA
    run's ``frozen/dense/decay/0``, or its ``frozen/dense/layers.3/decay/0``), each with its
    ``BaseSource``; the others keep swap files."""
    root = Path(base)
    layout = store.read_manifest(root).layout
    dtype, where = TORCH_DTYPES[layout.dtype], member_offsets(layout)
    identities: dict[str, FileIdentity] = {}
    out = {}
    for slot in slots:
        found = _contiguous(where, slot.partition.offsets)
        if found is None:
            continue
        f, start = found
        lo, hi = slot.rank_range(slot.dp_rank)
        if f.name not in identities:
            identities[f.name] = FileIdentity.of(root / f.name)
        out[slot] = BaseSource(root / f.name, f.data_start + (start + lo) * f.itemsize, hi - lo,
                               dtype, identities[f.name])
    io = AsyncIO(chunk_bytes=options.chunk_bytes, direct=options.direct_io, readonly=True)
    return BaseFiles(out, io)


def member_offsets(layout) -> dict:
    """Each member (``Slice``) of the base's groups -> (its group's file, its element offset
    in the group: the plan's own layout of a group, ``partition_group``)."""
    return {member: (f, at)
            for group, f in zip(layout.groups, layout.model_files, strict=True)
            for member, at in partition_group(group, world_size=group.ep_size).offsets}


def _contiguous(where: dict, offsets) -> tuple | None:
    """(file, element offset) where a slot's members (``Partition.offsets``: each with its
    offset in the slot's group) lie back to back in one base group, else None."""
    first = where.get(offsets[0][0]) if offsets else None
    if first is None:
        return None
    f, start = first
    return first if all(where.get(m) == (f, start + at) for m, at in offsets) else None


def read_source(io, source: BaseSource, buf: torch.Tensor) -> Future:
    """Fill ``buf`` (a slot's padded shard in the compute dtype) from ``source``: its real
    elements read in place (straight into ``buf`` when the dtypes agree, else read raw and
    upcast exactly when the read completes), the padding zero. The raw buffer starts at the
    file offset's place modulo ``ALIGN``, so the aligned middle of the range is read with
    O_DIRECT where the filesystem allows it."""
    source.check()
    buf[source.numel:].zero_()
    if source.dtype == buf.dtype:
        return io.read(source.path, buf[:source.numel], source.offset)
    shift, nbytes = source.offset % ALIGN, source.numel * source.dtype.itemsize
    raw = aligned_empty(nbytes + ALIGN, torch.uint8)[shift:shift + nbytes].view(source.dtype)
    done: Future = Future()

    def upcast(read: Future) -> None:
        try:
            read.result()
            buf[:source.numel].copy_(raw)
        except BaseException as exc:  # handed to the waiter
            done.set_exception(exc)
        else:
            done.set_result(raw.nbytes)

    io.read(source.path, raw, source.offset).add_done_callback(upcast)
    return done
