"""Reading a checkpoint while verifying it: no second pass over the bytes.

``CheckedReader`` stands in for a plain positional read in ``reading.read_range``,
``read_param`` and ``read_shard`` (their ``reader`` argument). The first read that touches a
checksummed range of the manifest reads that whole range, chunk by chunk, computing its crc32
while the requested bytes land in the caller's array (straight into it where a chunk lies
inside the request, through a scratch buffer where it does not); later reads of a verified
range read only what they ask for. When the current plan matches the saved one (the usual
resume) a rank's reads are exactly the ranges it saved, so every byte is read once. Each
file's safetensors header is compared byte for byte with the header its manifest's layout
gives, before its first data read. A mismatch raises ``CheckpointError`` naming the file and
the byte range, in ``verify``'s words. Torch counterpart: ``moezero.checkpoint.load``.
"""

from __future__ import annotations

import bisect
import os
import zlib
from pathlib import Path

import numpy as np

from moezero.plan.bytes_io import CHUNK, byte_view
from moezero.plan.files import CheckpointError, pread_into
from moezero.plan.layout import RangeRecord
from moezero.plan.manifest import Manifest
from moezero.plan.store import copy_range, write_range

__all__ = ["CheckedReader", "PlainReader"]


class PlainReader:
    """Positional reads of a checkpoint's files without checks (``verify_on_load: false``)."""

    def __init__(self, ckpt_dir: str | os.PathLike, manifest: Manifest, *, chunk: int = CHUNK):
        self.root, self.manifest, self.chunk = Path(ckpt_dir), manifest, chunk

    def read_into(self, name: str, out: np.ndarray, offset: int) -> None:
        """Fill ``out`` with the bytes of file ``name`` at ``offset``."""
        pread_into(self.root / name, out, offset)

    def copy_to(self, name: str, offset: int, length: int, dst: str | os.PathLike,
                dst_offset: int) -> None:
        """``length`` bytes of file ``name`` at ``offset`` into ``dst`` (file to file)."""
        copy_range(self.root / name, offset, dst, dst_offset, length)


class CheckedReader(PlainReader):
    """Reads that verify every checksummed range they touch and every file header."""

    def __init__(self, ckpt_dir: str | os.PathLike, manifest: Manifest, *, chunk: int = CHUNK):
        super().__init__(ckpt_dir, manifest, chunk=chunk)
        if chunk <= 0:
            raise ValueError(f"read chunk must be positive, got {chunk}")
        self._records: dict[str, list[RangeRecord]] = {}
        for r in sorted(manifest.checksums):
            if r.length:
                self._records.setdefault(r.file, []).append(r)
        self._starts = {f: [r.offset for r in rs] for f, rs in self._records.items()}
        self._verified: set[RangeRecord] = set()
        self._headers: set[str] = set()

    def read_into(self, name: str, out: np.ndarray, offset: int) -> None:
        view = byte_view(out)
        self._check_header(name)
        end = offset + len(view)
        with open(self.root / name, "rb", buffering=0) as f:
            for r in self._overlapping(name, offset, end):
                if r in self._verified:
                    lo, hi = max(offset, r.offset), min(end, r.offset + r.length)
                    _pread_exact(f.fileno(), view[lo - offset:hi - offset], lo, self.root / name)
                else:
                    self._read_record(f.fileno(), r, view, offset)

    def copy_to(self, name: str, offset: int, length: int, dst: str | os.PathLike,
                dst_offset: int) -> None:
        """File to file (``copy_range``) for each range that lies whole inside the bytes and
        is not verified yet, checked by the crc32 the copy computes; the rest (a range's part)
        through a host buffer of ``chunk`` bytes read by ``read_into``."""
        self._check_header(name)
        end = offset + length
        for r in self._overlapping(name, offset, end):
            lo, hi = max(offset, r.offset), min(end, r.offset + r.length)
            at = dst_offset + lo - offset
            if (lo, hi) == (r.offset, r.offset + r.length) and r not in self._verified:
                self._check_crc(r, copy_range(self.root / name, lo, dst, at, hi - lo))
                continue
            host = np.empty(min(self.chunk, hi - lo), np.uint8)
            for pos in range(lo, hi, host.size):
                part = host[:min(host.size, hi - pos)]
                self.read_into(name, part, pos)
                write_range(dst, at + pos - lo, part)

    def _overlapping(self, name: str, begin: int, end: int) -> list[RangeRecord]:
        """The records of file ``name`` that overlap bytes [begin, end), in order; the
        records tile the file (``read_manifest`` checked it)."""
        records, starts = self._records.get(name, []), self._starts.get(name, [])
        first = max(bisect.bisect_right(starts, begin) - 1, 0)
        return [r for r in records[first:bisect.bisect_left(starts, end)]
                if r.offset + r.length > begin]

    def _read_record(self, fd: int, r: RangeRecord, view: memoryview, offset: int) -> None:
        """Read all of record ``r`` in chunks, computing its crc32; the bytes inside the
        request [offset, offset + len(view)) land in ``view``."""
        end, crc, scratch = offset + len(view), 0, None
        for pos in range(r.offset, r.offset + r.length, self.chunk):
            size = min(self.chunk, r.offset + r.length - pos)
            if offset <= pos and pos + size <= end:  # the chunk lies inside the request
                chunk = view[pos - offset:pos - offset + size]
                _pread_exact(fd, chunk, pos, self.root / r.file)
            else:
                if scratch is None:
                    scratch = memoryview(bytearray(min(self.chunk, r.length)))
                chunk = scratch[:size]
                _pread_exact(fd, chunk, pos, self.root / r.file)
                lo, hi = max(offset, pos), min(end, pos + size)
                if lo < hi:
                    view[lo - offset:hi - offset] = chunk[lo - pos:hi - pos]
            crc = zlib.crc32(chunk, crc)
        self._check_crc(r, crc)

    def _check_crc(self, r: RangeRecord, crc: int) -> None:
        if crc != r.crc32:
            raise CheckpointError(f"{self.root}: {r.file} bytes [{r.offset}, "
                                  f"{r.offset + r.length}): crc32 {crc:08x}, manifest says "
                                  f"{r.crc32:08x}")
        self._verified.add(r)

    def _check_header(self, name: str) -> None:
        """The file's header bytes equal the header its manifest's layout gives."""
        if name in self._headers:
            return
        want = self.manifest.layout.file(name).header
        got = np.empty(len(want), np.uint8)
        pread_into(self.root / name, got, 0)
        if got.tobytes() != want:
            raise CheckpointError(f"{self.root}: {name} bytes [0, {len(want)}): the "
                                  "safetensors header differs from the manifest's layout")
        self._headers.add(name)


def _pread_exact(fd: int, view: memoryview, offset: int, path: Path) -> None:
    """Fill ``view`` from ``fd`` at ``offset``; CheckpointError where the file ends early."""
    while view:
        got = os.preadv(fd, [view], offset)
        if got == 0:
            raise CheckpointError(f"{path}: truncated at byte {offset}")
        view, offset = view[got:], offset + got
