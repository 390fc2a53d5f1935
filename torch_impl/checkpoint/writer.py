"""How a rank's checkpoint bytes reach the disk: the writes of one save on one rank
(``SaveWriter``, the storage writer), the O_DIRECT range writer that ``store.write_partition``
drives (``RangeWriter``) and the flush after a rank's last write (``FolderFlush``). They take
their behaviour from ``moezero.offload.options.IOOptions`` (or constructor arguments), never
from module state. Used by ``moezero.checkpoint.save``; docs/checkpoint.md ("Write path").
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import re
import sys
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import torch

from moezero.offload.aio import ALIGN, AsyncIO, aligned_empty
from moezero.offload.options import IOOptions
from moezero.plan import store
from moezero.plan.bytes_io import byte_view
from moezero.plan.layout import STATES, Layout, RangeRecord, rank_ranges
from moezero.plan.partition import Partition

__all__ = ["FolderFlush", "RangeWriter", "SaveWriter", "named", "system_syncfs"]


class SaveWriter:
    """The writes of one save on one rank (DCP's storage writer): this rank's partitions
    (``shard``: tensors through a ``RangeWriter``, swapped shards file to file), then on rank 0
    the manifest and the commit. ``save.write`` makes one per save with ``IOOptions.save_writer``
    (this class when None) and uses it as a context (the range writer's writes are waited for
    on leaving it). Tests pass a subclass that delays or fails these writes
    (``tests/support/faulty_save.py``): fault injection is no option of a run.
    """

    def __init__(self, io: IOOptions, refused: set[int], *, rank: int, step: int):
        self.io, self.refused, self.rank, self.step = io, refused, rank, step
        self._ranges: RangeWriter | None = None

    def __enter__(self) -> SaveWriter:
        self._ranges = RangeWriter(self.io, self.refused)
        return self

    def __exit__(self, kind, *exc) -> None:
        ranges, self._ranges = self._ranges, None
        ranges.__exit__(kind, *exc)

    def shard(self, partial: Path, layout: Layout, partition: Partition, dp_rank: int, *,
              arrays: dict[str, np.ndarray] | None = None,
              files: dict[str, Path] | None = None) -> list[RangeRecord]:
        """Write this rank's partition of one group (``arrays``: state -> fp32 array, or
        ``files``: state -> swap file); returns the checksummed ranges."""
        if files is not None:
            return _copy_partition(partial, layout, partition, dp_rank, files)
        return store.write_partition(partial, layout, partition, dp_rank, **arrays,
                                     fsync=False, writer=_naming(self._ranges))

    def manifest(self, partial: Path, layout: Layout, **fields) -> None:
        """Rank 0: ``store.write_manifest(partial, layout, **fields)``."""
        store.write_manifest(partial, layout, **fields)

    def commit(self, partial: Path, layout: Layout) -> Path:
        """Rank 0, after every rank flushed: ``store.commit``; returns the step directory."""
        return store.commit(partial, flushed=True, layout=layout)


def named(exc: BaseException, path: Path) -> BaseException:
    """``exc``, or for an OS error that names no file (a plain ``pwrite`` on a full disk:
    ``[Errno 28] No space left on device``) the same error naming ``path``."""
    if isinstance(exc, OSError) and exc.filename is None and exc.strerror:
        return OSError(exc.errno, exc.strerror, os.fspath(path))
    return exc


def _naming(writer):
    """``writer(path, offset, array)`` whose OS errors name the file they hit."""
    def write(path: Path, offset: int, array: np.ndarray) -> int:
        try:
            return writer(path, offset, array)
        except OSError as exc:
            if exc.filename is not None:
                raise
            raise named(exc, path) from exc
    return write


def _copy_partition(ckpt_dir: Path, layout: Layout, partition: Partition, dp_rank: int,
                    files: dict[str, Path]) -> list[RangeRecord]:
    """A swapped shard's real elements, swap file -> checkpoint file (``os.copy_file_range``),
    with the checksum of each range."""
    ranges = rank_ranges(layout, partition, dp_rank)
    records = []
    for state in STATES:
        where = getattr(ranges, state)
        if where is not None and where.length:
            try:
                crc = store.copy_range(files[state], 0, ckpt_dir / where.file,
                                       where.offset, where.length)
            except OSError as exc:
                if exc.filename is not None:
                    raise
                raise named(exc, ckpt_dir / where.file) from exc
            records.append(RangeRecord(where.file, where.offset, where.length, crc))
    return records


class RangeWriter:
    """``store.write_partition``'s writer: each range's aligned bulk with O_DIRECT.

    A range is staged chunk by chunk (at most ``options.stage_bytes``) into one of two aligned
    buffers, at an address congruent to its file offset modulo ``ALIGN``; ``AsyncIO`` then
    writes the aligned middle with O_DIRECT and the unaligned head and tail (< 4 KiB each)
    buffered. While one buffer is written the next chunk is copied into the other. The crc32
    is taken from the source bytes. Writes return before the bytes are on disk: ``close``
    (or leaving the ``with``) waits for them. Ranges shorter than ``options.direct_min_bytes``,
    and every range where O_DIRECT is refused (or ``options.direct_io`` is False), are written
    by ``store.write_range``, through the page cache. ``refused`` collects the ``st_dev`` of
    filesystems that refused O_DIRECT (share it between writers to probe each one once).
    """

    def __init__(self, options: IOOptions | None = None, refused: set[int] | None = None):
        options = options or IOOptions()
        self.aio: AsyncIO | None = None  # started by the first range that may use it
        self._allowed = options.direct_io and hasattr(os, "O_DIRECT")
        self._stage, self._min = options.stage_bytes, options.direct_min_bytes
        self._chunk = options.chunk_bytes
        self._refused = set() if refused is None else refused
        self._bufs: list[torch.Tensor | None] = [None, None]
        self._pending: list[Future | None] = [None, None]
        self._turn = 0
        self._direct: dict[str, bool] = {}  # folder -> O_DIRECT works there

    def __call__(self, path: Path, offset: int, array: np.ndarray) -> int:
        src = byte_view(array)
        if len(src) < self._min or not self._uses_direct(path):
            return store.write_range(path, offset, src)
        size = os.stat(path).st_size
        if offset < 0 or offset + len(src) > size:
            raise ValueError(f"{path}: range [{offset}, {offset + len(src)}) is outside the "
                             f"{size}-byte file")
        crc, pos = 0, 0
        while pos < len(src):  # chunks end on ALIGN boundaries of the file
            at = (offset + pos) % ALIGN
            piece = src[pos:pos + min(len(src) - pos, self._stage - at)]
            k, buf = self._buffer(at + len(piece))
            buf = buf[at:at + len(piece)]
            buf.numpy()[:] = np.frombuffer(piece, np.uint8)
            crc = zlib.crc32(piece, crc)
            self._pending[k] = self.aio.write(path, buf, offset + pos)
            pos += len(piece)
        return crc

    def _uses_direct(self, path: Path) -> bool:
        """Whether ``path``'s folder takes O_DIRECT (probed on its first file)."""
        folder = os.path.dirname(os.path.abspath(path))
        if folder not in self._direct:
            dev = os.stat(folder).st_dev
            ok = self._allowed and dev not in self._refused
            if ok:  # an empty read opens the file and probes O_DIRECT in its folder
                self.aio = self.aio or AsyncIO(chunk_bytes=self._chunk, direct=True)
                try:
                    self.aio.read(path, torch.empty(0, dtype=torch.uint8)).result()
                except OSError:
                    return False  # store.write_range names the problem
                ok = self.aio.uses_direct(path)
                if not ok:
                    self._refused.add(dev)
            self._direct[folder] = ok
        return self._direct[folder]

    def _buffer(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """The next staging buffer (index, tensor) of at least ``nbytes``, once its last write
        finished."""
        k, self._turn = self._turn, self._turn ^ 1
        pending, self._pending[k] = self._pending[k], None
        if pending is not None:
            pending.result()
        if self._bufs[k] is None or self._bufs[k].numel() < nbytes:
            old = 0 if self._bufs[k] is None else self._bufs[k].numel()
            self._bufs[k] = aligned_empty(min(self._stage, max(nbytes, 2 * old)), torch.uint8)
        return k, self._bufs[k]

    def close(self) -> None:
        """Wait for every write (raising the first failure) and release the descriptors."""
        error = None
        for k, pending in enumerate(self._pending):
            self._pending[k] = None
            try:
                if pending is not None:
                    pending.result()
            except OSError as exc:
                error = error or exc
        if self.aio is not None:
            self.aio.close()
        if error is not None:
            raise error

    def __enter__(self) -> RangeWriter:
        return self

    def __exit__(self, kind, *exc) -> None:
        try:
            self.close()
        except OSError:
            if kind is None:
                raise


class FolderFlush:
    """Makes a rank's checkpoint files durable after its last write: one ``syncfs`` of the
    folder's filesystem where that is known to be enough, else ``fsync`` file by file.

    Create it before the rank's first write into ``folder`` (so the filesystem's writeback
    error mark is taken before any of them), call ``flush(names)`` after the last one.
    ``syncfs`` is ``system_syncfs()`` (libc's, where it reports errors) or None: per-file
    fsyncs everywhere (``IOOptions.syncfs`` False).

    One syncfs is one journal commit and one device cache flush for every file a rank wrote
    (a checkpoint has one file per group and state: ~70 for a 16-expert model, where per-file
    fsyncs took 25-90 ms a save here and syncfs 4-16 ms). syncfs is used only on Linux >= 5.8
    (older kernels do not report writeback errors from it) and on the local filesystems of
    ``SYNCFS_FILESYSTEMS``; NFS, FUSE (incl. fuseblk), overlay, tmpfs and the rest get per-file
    fsyncs, which every one of them implements. syncfs also flushes other processes' dirty
    pages on that filesystem: on a disk shared with heavy writers a save waits for them.
    """

    def __init__(self, folder: Path, syncfs: Callable[[int], int] | None = None):
        self.folder, self.fd, self._syncfs = Path(folder), None, syncfs
        if syncfs is not None and _fs_type(self.folder) in SYNCFS_FILESYSTEMS:
            self.fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY)

    def flush(self, names: list[str]) -> None:
        if names and self.fd is not None:
            if self._syncfs(self.fd) == 0:
                return
            err = ctypes.get_errno()
            if err not in (errno.ENOSYS, errno.EOPNOTSUPP):
                raise OSError(err, f"syncfs: {os.strerror(err)}", os.fspath(self.folder))
        for name in names:
            store.fsync_file(self.folder / name)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> FolderFlush:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


SYNCFS_FILESYSTEMS = {0xEF53: "ext2/3/4", 0x58465342: "xfs", 0x9123683E: "btrfs",
                      0xF2F52010: "f2fs"}
"""``statfs`` magic numbers of the local filesystems whose syncfs flushes every dirty file
and the device cache (``FolderFlush``)."""


def _fs_type(folder: Path) -> int | None:
    """``statfs(folder).f_type`` (the first field of ``struct statfs`` on Linux), or None."""
    buf = ctypes.create_string_buffer(512)  # larger than struct statfs on every Linux ABI
    try:
        if _LIBC.statfs(os.fsencode(folder), buf) != 0:
            return None
    except AttributeError:
        return None
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


@functools.cache
def system_syncfs() -> Callable[[int], int] | None:
    """libc's ``syncfs(fd)`` on Linux >= 5.8 (it reports writeback errors since then), or
    None."""
    release = re.match(r"(\d+)\.(\d+)", os.uname().release) if hasattr(os, "uname") else None
    if not sys.platform.startswith("linux") or not release \
            or tuple(map(int, release.groups())) < (5, 8):
        return None
    return getattr(_LIBC, "syncfs", None)


try:
    _LIBC = ctypes.CDLL(None, use_errno=True)
except OSError:  # no libc to load: statfs and syncfs are unknown, fsync is used
    _LIBC = None
