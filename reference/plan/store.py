"""Checkpoint file I/O on numpy arrays: write ranges, headers and the manifest; the public
face of the store (reading and step directories re-exported from their modules).

Both sides call this with numpy arrays (torch hands ``tensor.numpy()`` views of its fp32
shards). The byte layout comes from ``moezero.plan.layout``; the store only moves bytes.
Save, rank by rank (docs/checkpoint.md):

1. rank 0: ``begin_save`` → ``write_headers`` (creates and preallocates every file);
2. every rank: ``write_partition`` for each group it holds → its ``RangeRecord``s;
3. rank 0, after gathering all records: ``write_manifest`` → ``commit`` →
   ``apply_retention``.

Load: ``find_latest`` → ``read_manifest`` → ``read_shard`` per group and state (contiguous
when the group is unchanged, per-tensor slices otherwise). Writing is here; reading is
``moezero.plan.reading``, step directories (commit, ``latest``, retention)
``moezero.plan.stepdirs``, file primitives ``moezero.plan.files``. Torch counterpart:
``moezero.checkpoint.core``.
"""

from __future__ import annotations

import errno
import os
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from moezero.plan.bytes_io import CHUNK, byte_view
from moezero.plan.files import (
    CheckpointError,
    fsync_dir,
    fsync_file,
    pwrite_all,
    write_json,
)
from moezero.plan.layout import (
    INDEX_NAME,
    MANIFEST_NAME,
    Layout,
    RangeRecord,
    index_json,
    rank_ranges,
)
from moezero.plan.manifest import Manifest, check_tiling, manifest_to_json
from moezero.plan.partition import Partition
from moezero.plan.reading import (
    check_shapes,
    read_manifest,
    read_param,
    read_range,
    read_shard,
    read_tensors,
    verify,
)
from moezero.plan.rules import STATES
from moezero.plan.stepdirs import (
    PARTIAL,
    STALE,
    apply_retention,
    begin_save,
    commit,
    complete_steps,
    find_checkpoint,
    find_latest,
    step_dir_name,
)

__all__ = [
    "CHUNK", "PARTIAL", "STALE", "CheckpointError", "apply_retention", "begin_save",
    "check_shapes", "commit", "complete_steps", "copy_range", "find_checkpoint", "find_latest", "fsync_dir",
    "fsync_file", "read_manifest", "read_param", "read_range", "read_shard", "read_tensors",
    "step_dir_name", "verify", "write_headers", "write_manifest", "write_partition",
    "write_range",
]


def write_range(path: str | os.PathLike, offset: int, array: np.ndarray | bytes) -> int:
    """Write ``array``'s bytes at ``offset`` of an existing, preallocated file.

    Writes with ``os.pwrite`` in chunks of at most 8 MiB; never extends the file.

    Returns:
        The zlib crc32 of the bytes written, computed while writing.
    """
    data = byte_view(array)
    fd = os.open(path, os.O_WRONLY)
    try:
        size = os.fstat(fd).st_size
        if offset < 0 or offset + len(data) > size:
            raise ValueError(f"{path}: range [{offset}, {offset + len(data)}) is outside "
                             f"the {size}-byte file")
        crc = 0
        for pos in range(0, len(data), CHUNK):
            chunk = data[pos:pos + CHUNK]
            pwrite_all(fd, chunk, offset + pos)
            crc = zlib.crc32(chunk, crc)
    finally:
        os.close(fd)
    return crc


def write_headers(layout: Layout, ckpt_dir: str | os.PathLike) -> list[RangeRecord]:
    """Create and preallocate every file, write its header and the index (rank 0 only).

    Returns:
        One checksum record per header (bytes ``[0, data_start)`` of each file).
    """
    root = Path(ckpt_dir)
    records = []
    for f in layout.files:
        crc = _create(root / f.name, f.size, f.header)
        records.append(RangeRecord(f.name, 0, f.data_start, crc))
    write_json(root / INDEX_NAME, index_json(layout))
    return records


def _create(path: Path, size: int, header: bytes = b"") -> int:
    """Create ``path`` preallocated to ``size`` bytes with ``header`` at offset 0; returns
    the header's crc32."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except (AttributeError, OSError):  # not every filesystem can; a sparse file will do
            os.ftruncate(fd, size)
        pwrite_all(fd, memoryview(header).cast("B"), 0)
    finally:
        os.close(fd)
    return zlib.crc32(header)


def write_partition(ckpt_dir: str | os.PathLike, layout: Layout, partition: Partition,
                    dp_rank: int, *, master: np.ndarray, exp_avg: np.ndarray | None = None,
                    exp_avg_sq: np.ndarray | None = None, fsync: bool = True,
                    writer: Callable[[Path, int, np.ndarray], int] | None = None,
                    ) -> list[RangeRecord]:
    """Write one DP rank's shard of one group (every state) at its ranges from the layout.

    Args:
        ckpt_dir: The ``.partial`` directory whose files ``write_headers`` created.
        layout: The layout being saved.
        partition: The group's partition in the current plan (same members as saved).
        dp_rank: This rank's DP rank in the group.
        master, exp_avg, exp_avg_sq: The rank's fp32 shards (``shard_numel`` elements,
            padding included, or at least the real elements; only those are written). The
            moments are None for a frozen group (its layout has no optim file).
        fsync: Flush the written files before returning (do it on the writing host).
        writer: ``writer(path, offset, array) -> crc32`` writes one range into the existing
            file and returns the crc32 of its bytes (default ``write_range``; the torch side
            passes one that uses O_DIRECT). The records hold what it returns. A writer that
            returns before its bytes are written needs ``fsync=False`` and its own flush.

    Returns:
        The non-empty ranges written with their crc32, for the manifest.
    """
    ranges = rank_ranges(layout, partition, dp_rank)
    writer, records = writer or write_range, []
    for state, shard in zip(STATES, (master, exp_avg, exp_avg_sq), strict=True):
        where = getattr(ranges, state)
        if where is not None and where.length:  # None: a weights-only layout's moments
            data = _real_elements(shard, ranges.numel, f"{partition.group} {state}")
            crc = writer(Path(ckpt_dir) / where.file, where.offset, data)
            records.append(RangeRecord(where.file, where.offset, where.length, crc))
    for name in sorted({r.file for r in records} if fsync else ()):
        fsync_file(Path(ckpt_dir) / name)
    return records


def copy_range(src: str | os.PathLike, src_offset: int, dst: str | os.PathLike,
               dst_offset: int, length: int) -> int:
    """Copy ``length`` bytes file to file (an NVMe swap partition <-> its checkpoint range).

    Chunk by chunk (at most 8 MiB): ``os.copy_file_range`` moves the bytes inside the kernel
    (a reflink or server-side copy where the filesystem has one, never a user-space write),
    then the same source chunk is read back, from the page cache the copy just filled, for
    the checksum. Where the kernel copy is refused (EXDEV, ENOSYS, EINVAL, EOPNOTSUPP) the
    rest is pread/pwrite. ``dst`` must exist and be large enough (it is never extended).

    Returns:
        The crc32 of the bytes copied.
    """
    crc, kernel = 0, hasattr(os, "copy_file_range")
    with open(src, "rb") as fin, open(dst, "r+b") as fout:
        if dst_offset < 0 or dst_offset + length > os.fstat(fout.fileno()).st_size:
            raise ValueError(f"{dst}: range [{dst_offset}, {dst_offset + length}) is outside it")
        for pos in range(0, length, CHUNK):
            size = min(CHUNK, length - pos)
            if kernel:
                kernel = _kernel_copy(fin.fileno(), src_offset + pos, fout.fileno(),
                                      dst_offset + pos, size)
            data = os.pread(fin.fileno(), size, src_offset + pos)
            if len(data) != size:
                raise CheckpointError(f"{src}: truncated at byte {src_offset + pos + len(data)}")
            if not kernel:
                pwrite_all(fout.fileno(), memoryview(data), dst_offset + pos)
            crc = zlib.crc32(data, crc)
    return crc


_NO_KERNEL_COPY = frozenset({errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP})


def _kernel_copy(fd_in: int, src: int, fd_out: int, dst: int, size: int) -> bool:
    """``os.copy_file_range`` of ``size`` bytes; False if the kernel or filesystem refuses it.

    Stops early at the source's end (the caller's read finds the truncation).
    """
    try:
        while size:
            done = os.copy_file_range(fd_in, fd_out, size, src, dst)
            if not done:
                break
            src, dst, size = src + done, dst + done, size - done
    except OSError as err:
        if err.errno not in _NO_KERNEL_COPY:
            raise
        return False
    return True


def _real_elements(shard: np.ndarray, numel: int, what: str) -> np.ndarray:
    shard = np.asarray(shard)
    if shard.dtype != np.float32:
        raise ValueError(f"{what}: shard must be float32, got {shard.dtype}")
    if shard.size < numel:
        raise ValueError(f"{what}: shard has {shard.size} elements, need at least {numel}")
    return shard.reshape(-1)[:numel]


def write_manifest(ckpt_dir: str | os.PathLike, layout: Layout, *,
                   checksums: Iterable[RangeRecord], config: dict | None = None,
                   topology: dict | None = None, state: dict | None = None,
                   base: dict | None = None) -> Path:
    """Write ``manifest.json`` atomically once every rank's ranges are on disk (rank 0).

    Args:
        checksums: The header records and every rank's partition records; together they
            must tile every file exactly (checked, ValueError naming the first gap).
        config, topology, state: Opaque JSON objects (resolved config; world size, ep
            sizes, stage at save; RNG, data position, loss scaler, lr step).
        base: ``{"path", "sha256"}`` of the base checkpoint holding the frozen params.
    """
    records = tuple(sorted(RangeRecord(*r) for r in checksums))
    check_tiling(layout, records)
    manifest = Manifest(layout, records, config or {}, topology or {}, state or {}, base or {})
    path = Path(ckpt_dir) / MANIFEST_NAME
    write_json(path, manifest_to_json(manifest))
    return path
