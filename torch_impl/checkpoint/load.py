"""Loading a checkpoint into state: the optimizer's load targets and this rank's small state.

The loader receives what to fill (``plan.state_shard.StateShard`` targets: views of the live
fp32 state, or the NVMe swap files) and returns this rank's JSON state; it never sees the trainer.
Each target is read under the *current* plan with ``store.read_shard``, whatever world size,
``ep``, stage or group cap saved it; a swap-file target whose group the checkpoint holds
unchanged is filled file to file (``store.copy_range``), any other span by span through one
host buffer of ``chunk`` bytes (never a whole group or tensor); a target in host memory is
read straight into. The manifest and shapes are checked before anything is read; with
``verify`` (the default, ``checkpoint.verify_on_load``) every byte is read through
``moezero.plan.checked.CheckedReader``, which checks each range's crc32 while reading it and
each file's header against the manifest, so a damaged checkpoint fails in one line naming the
file and byte range, and the caller derives nothing from it. Only JSON and safetensors are read.
Reference counterpart: ``moezero.plan.store`` and ``moezero.reference.checkpoint``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path

import numpy as np
import torch

from moezero.checkpoint.model_buffers import read_buffers
from moezero.checkpoint.save import RANK_KEYS
from moezero.plan import store
from moezero.plan.bytes_io import CHUNK
from moezero.plan.checked import CheckedReader, PlainReader
from moezero.plan.layout import ITEMSIZE, rank_ranges, same_group
from moezero.plan.model_buffer_io import check_buffers
from moezero.plan.rules import STATES
from moezero.plan.state_shard import StateShard
from moezero.plan.store import CheckpointError, find_checkpoint


def resolve_load(value: str, root: str | os.PathLike) -> Path:
    """``checkpoint.load`` to a checked step directory: ``latest`` is the newest complete one
    under ``root``; a relative path is looked up under ``root`` first, then the working dir."""
    root = Path(root)
    if value == "latest":
        if not root.is_dir():
            raise CheckpointError(f"checkpoint.load: latest: no checkpoint root {root}")
        path = root
    else:
        path = Path(value)
        if not path.is_absolute() and (root / path).exists():
            path = root / path
        elif not path.exists():
            where = "" if path.is_absolute() else f" (looked under {root} and the working directory)"
            raise CheckpointError(f"checkpoint.load: {value}: no such checkpoint directory{where}")
    try:
        ckpt = find_checkpoint(path)
        store.read_manifest(ckpt)
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint.load: {exc}") from None
    return ckpt


def read_checkpoint(path: str | os.PathLike, targets: Iterable[StateShard],
                    shapes: dict[str, tuple[int, ...]], rank: int,
                    buffers: dict | None = None, *, verify: bool = True,
                    chunk: int = CHUNK, exact: bool = True, only: bool = False) -> dict:
    """Fill ``targets`` from the checkpoint at ``path`` (a step directory or a root: its
    newest complete checkpoint) and return ``rank``'s state: the saved JSON state with each
    per-rank entry (``save.RANK_KEYS``) replaced by this rank's (``rank % saved world``: a rank
    that did not exist at save takes another's), or {} for a weights-only checkpoint, whose
    moments are zeroed. ``buffers`` (``{fqn: tensor}``) are filled too (zero where the
    checkpoint has none). ``verify``: check every range read and every header (``chunk``
    bytes per read). ``only``: fill the masters of the params in ``shapes`` alone, leaving
    the rest of each target as it is, and return {} (a fresh LoRA run's un-frozen base params,
    read from its base beside its initial adapters). Raises CheckpointError, OSError or
    ValueError (one line)."""
    where = find_checkpoint(path)
    manifest = store.read_manifest(where)
    store.check_shapes(manifest, shapes, where, exact=exact)
    buffers = buffers or {}
    check_buffers(manifest, {k: tuple(t.shape) for k, t in buffers.items()}, where)
    saved = ("master",) if manifest.layout.weights_only else STATES
    reader = (CheckedReader if verify else PlainReader)(where, manifest, chunk=chunk)
    if only:
        for target in targets:
            _fill_masters(reader, target, shapes.keys())
        return {}
    for target in targets:
        fill = _fill_files if target.files is not None else _fill_tensors
        fill(reader, target, saved)
    read_buffers(buffers, where, manifest, reader)
    if manifest.layout.weights_only:
        return {}
    state = dict(manifest.state)
    for key in RANK_KEYS:
        entries = state.pop(key, None) or []
        if entries:
            state[key] = entries[rank % len(entries)]
    return state


def _fill_tensors(reader: PlainReader, target: StateShard, saved) -> None:
    """Each state of one target from the checkpoint (a state it lacks is zeroed)."""
    part = target.partition
    for s, t in target.tensors.items():
        if s not in saved:
            t.detach().zero_()
        elif t.numel():
            _read_into(t, partial(store.read_shard, reader.root, reader.manifest, part,
                                  target.dp_rank, s, reader=reader), part.shard_numel,
                       reader.chunk)


def _fill_masters(reader: PlainReader, target: StateShard, fqns) -> None:
    """The master of each piece of ``target``'s range whose param is in ``fqns``, piece by
    piece (the other pieces and states are left as they are)."""
    for piece, at in target.partition.rank_slices(target.dp_rank):
        if piece.fqn not in fqns:
            continue
        for lo, host in _spans(piece.numel, reader.chunk):
            store.read_param(reader.root, reader.manifest, piece.fqn, piece.start + lo,
                             piece.start + lo + host.size, out=host, reader=reader)
            if target.files is not None:
                store.write_range(target.files["master"], (at + lo) * ITEMSIZE, host)
            else:
                target.tensors["master"].detach().view(-1)[at + lo:at + lo + host.size] \
                    .copy_(torch.from_numpy(host))


def _read_into(tensor: torch.Tensor, read: Callable, numel: int, chunk: int) -> None:
    """``read(out=..., span=...)`` of ``numel`` elements into a float32 tensor: straight into
    it when on the CPU and of that size, else through a host buffer of ``chunk`` bytes, span by
    span (its real elements only)."""
    if tensor.device.type == "cpu" and tensor.numel() == numel:
        read(out=tensor.detach().reshape(-1).numpy())
        return
    flat, numel = tensor.detach().view(-1), min(numel, tensor.numel())
    for lo, host in _spans(numel, chunk):
        flat[lo:lo + host.size].copy_(torch.from_numpy(read(out=host, span=(lo, lo + host.size))))


def _spans(numel: int, chunk: int):
    """``(lo, buffer)`` covering ``numel`` elements: one reused float32 buffer of at most
    ``chunk`` bytes, cut to size at the end."""
    host = np.empty(max(1, min(numel, chunk // ITEMSIZE)), np.float32)
    for lo in range(0, numel, host.size):
        yield lo, host[:min(host.size, numel - lo)]


def _fill_files(reader: PlainReader, target: StateShard, saved) -> None:
    """A swap-file target: file to file where the checkpoint holds the group unchanged, in fp32
    (any world size: the rank's range is then one byte range per state), else read and written
    span by span through a host buffer of ``reader.chunk`` bytes. Padding and the states the
    checkpoint lacks become zeros."""
    part, size = target.partition, target.partition.shard_numel * ITEMSIZE
    manifest = reader.manifest
    if same_group(manifest.layout, part) and manifest.layout.dtype == "F32":  # bytes as stored
        ranges = rank_ranges(manifest.layout, part, target.dp_rank)
        for s, path in target.files.items():
            where_s, done = getattr(ranges, s), 0
            if s in saved and where_s is not None and where_s.length:
                reader.copy_to(where_s.file, where_s.offset, where_s.length, path, 0)
                done = where_s.length
            _zero_fill(path, done, size)
        return
    for s, path in target.files.items():
        if s not in saved:
            _zero_fill(path, 0, size)
            continue
        for lo, host in _spans(part.shard_numel, reader.chunk):
            store.read_shard(reader.root, manifest, part, target.dp_rank, s, out=host,
                             reader=reader, span=(lo, lo + host.size))
            store.write_range(path, lo * ITEMSIZE, host)


def _zero_fill(path, start: int, stop: int) -> None:
    """Zeros in bytes [start, stop) of an existing file."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        for at in range(start, stop, CHUNK):
            os.pwrite(fd, bytes(min(CHUNK, stop - at)), at)
    finally:
        os.close(fd)
