"""Checkpoint file I/O on numpy arrays: write ranges, manifest, resharding reads, verify, commit.

Both sides call this with numpy arrays (torch hands ``tensor.numpy()`` views of its fp32
shards). The byte layout comes from ``moezero.plan.layout``; this module only moves
bytes. Save, rank by rank (docs/checkpoint.md):

1. rank 0: ``begin_save`` → ``write_headers`` (creates and preallocates every file);
2. every rank: ``write_partition`` for each group it holds → its ``RangeRecord``s;
3. rank 0, after gathering all records: ``write_manifest`` → ``commit`` →
   ``apply_retention``.

Load: ``find_latest`` → ``read_manifest`` → ``read_shard`` per group and state (contiguous
when the group is unchanged, per-tensor slices otherwise). Torch counterpart:
``moezero.checkpoint.core``.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import stat
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from moezero.plan.layout import (
    INDEX_NAME,
    ITEMSIZE,
    MANIFEST_NAME,
    STATES,
    Layout,
    RangeRecord,
    index_json,
    rank_ranges,
    same_group,
)
from moezero.plan.manifest import Manifest, check_tiling, manifest_from_json, manifest_to_json
from moezero.plan.partition import Partition

CHUNK = 8 << 20  # bytes per pwrite/pread call
PARTIAL, STALE = ".partial", ".stale"
_STEP_DIR = re.compile(r"step_(\d{8,})(\.partial|\.stale)?")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message is one line naming the file."""


# ---------------------------------------------------------------- writing


def write_range(path: str | os.PathLike, offset: int, array: np.ndarray | bytes) -> int:
    """Write ``array``'s bytes at ``offset`` of an existing, preallocated file.

    Writes with ``os.pwrite`` in chunks of at most 8 MiB; never extends the file.

    Returns:
        The zlib crc32 of the bytes written, computed while writing.
    """
    data = _byte_view(array)
    fd = os.open(path, os.O_WRONLY)
    try:
        size = os.fstat(fd).st_size
        if offset < 0 or offset + len(data) > size:
            raise ValueError(f"{path}: range [{offset}, {offset + len(data)}) is outside "
                             f"the {size}-byte file")
        crc = 0
        for pos in range(0, len(data), CHUNK):
            chunk = data[pos:pos + CHUNK]
            _pwrite_all(fd, chunk, offset + pos)
            crc = zlib.crc32(chunk, crc)
    finally:
        os.close(fd)
    return crc


def _byte_view(array: np.ndarray | bytes) -> memoryview:
    if isinstance(array, np.ndarray):
        array = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return memoryview(array).cast("B")


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


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
    _write_json(root / INDEX_NAME, index_json(layout))
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
        _pwrite_all(fd, memoryview(header).cast("B"), 0)
    finally:
        os.close(fd)
    return zlib.crc32(header)


def write_partition(ckpt_dir: str | os.PathLike, layout: Layout, partition: Partition,
                    dp_rank: int, *, master: np.ndarray, exp_avg: np.ndarray,
                    exp_avg_sq: np.ndarray, fsync: bool = True,
                    writer: Callable[[Path, int, np.ndarray], int] | None = None,
                    ) -> list[RangeRecord]:
    """Write one DP rank's shard of one group (every state) at its ranges from the layout.

    Args:
        ckpt_dir: The ``.partial`` directory whose files ``write_headers`` created.
        layout: The layout being saved.
        partition: The group's partition in the current plan (same members as saved).
        dp_rank: This rank's DP rank in the group.
        master, exp_avg, exp_avg_sq: The rank's fp32 shards (``shard_numel`` elements,
            padding included, or at least the real elements; only those are written).
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
                _pwrite_all(fout.fileno(), memoryview(data), dst_offset + pos)
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
                   topology: dict | None = None, state: dict | None = None) -> Path:
    """Write ``manifest.json`` atomically once every rank's ranges are on disk (rank 0).

    Args:
        checksums: The header records and every rank's partition records; together they
            must tile every file exactly (checked, ValueError naming the first gap).
        config, topology, state: Opaque JSON objects (resolved config; world size, ep
            sizes, stage at save; RNG, data position, loss scaler, lr step).
    """
    records = tuple(sorted(RangeRecord(*r) for r in checksums))
    check_tiling(layout, records)
    manifest = Manifest(layout, records, config or {}, topology or {}, state or {})
    path = Path(ckpt_dir) / MANIFEST_NAME
    _write_json(path, manifest_to_json(manifest))
    return path


def _write_json(path: Path, obj: object) -> None:
    """Write JSON (strict: no NaN) to a temporary file, fsync it, rename over ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, allow_nan=False))
    fsync_file(tmp)
    os.replace(tmp, path)


def fsync_file(path: str | os.PathLike) -> None:
    """Flush a file's data and metadata to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory's entries (creations, renames) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- reading


def read_manifest(ckpt_dir: str | os.PathLike) -> Manifest:
    """Read and check a checkpoint's manifest; every file must exist with its size.

    Raises:
        CheckpointError: (one line) no/unreadable manifest, a file named outside the
            directory (absolute, ``..``, symlink escaping), a manifest inconsistent with
            its layout, or a missing/truncated file (named).
    """
    root = Path(ckpt_dir)
    path = root / MANIFEST_NAME
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{root}: no {MANIFEST_NAME} (incomplete checkpoint)") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: unreadable: {err}") from None
    base = os.path.realpath(root)
    for name in _named_files(obj):
        _resolve(root, name, base)
    try:
        manifest = manifest_from_json(obj)
    except ValueError as err:
        raise CheckpointError(f"{path}: {err}") from None
    for f in manifest.layout.files:
        _check_file(root / f.name, f.size)
    return manifest


def _named_files(obj: object) -> list:
    """Every distinct file name a manifest mentions (best effort on malformed input)."""
    if not isinstance(obj, dict):
        return []
    names = [f.get("name") for f in obj.get("files") or () if isinstance(f, dict)]
    names += [r[0] for r in obj.get("checksums") or () if isinstance(r, list) and r]
    odd = [n for n in names if not isinstance(n, str)]  # rejected by _resolve
    return odd[:1] + list(dict.fromkeys(n for n in names if isinstance(n, str)))


def _resolve(root: Path, name: object, base: str) -> Path:
    """``root / name``, refusing names that leave ``root`` (absolute, ``..``, symlinks).

    ``base`` is ``os.path.realpath(root)``, computed once by the caller.
    """
    bad = (not isinstance(name, str) or not name or "\0" in name or os.path.isabs(name)
           or ".." in Path(name).parts)
    if not bad and (os.sep in name or os.path.islink(os.path.join(base, name))):
        # a plain entry of ``base`` (the usual case) is inside; else resolve the links
        bad = os.path.commonpath([base, os.path.realpath(os.path.join(base, name))]) != base
    if bad:
        raise CheckpointError(f"{root}: manifest names a file outside the checkpoint "
                              f"directory: {name!r}")
    return root / name


def _check_file(path: Path, size: int) -> None:
    """A regular file of ``size`` bytes at ``path`` (already checked to stay inside)."""
    root, name = path.parent, path.name
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{root}: file {name} is missing") from None
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"{root}: {name} is not a regular file")
    if info.st_size != size:
        what = "truncated" if info.st_size < size else "too long"
        raise CheckpointError(f"{root}: file {name} is {what}: {info.st_size} bytes, "
                              f"expected {size}")


def read_param(ckpt_dir: str | os.PathLike, manifest: Manifest, fqn: str, start: int = 0,
               stop: int | None = None, state: str = "master", *,
               out: np.ndarray | None = None) -> np.ndarray:
    """Elements ``[start, stop)`` of flattened parameter ``fqn``'s ``state``, from any plan.

    Gathers from every file and fragment that holds part of the range (one ``pread`` per
    piece). ``stop=None`` means the end. Returns a 1-D float32 array (``out`` if given).
    """
    pieces = manifest.layout.pieces(fqn, state)
    numel = math.prod(manifest.layout.shape(fqn))
    stop = numel if stop is None else stop
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"param {fqn!r}: range [{start}, {stop}) is outside [0, {numel})")
    out = _output(out, stop - start)
    for f, t in pieces:
        lo, hi = max(start, t.start), min(stop, t.stop)
        if lo < hi:
            offset = f.data_start + t.begin + (lo - t.start) * ITEMSIZE
            _pread_into(Path(ckpt_dir) / f.name, out[lo - start:hi - start], offset)
    return out


def read_range(ckpt_dir: str | os.PathLike, manifest: Manifest, partition: Partition,
               dp_rank: int, state: str = "master", *,
               out: np.ndarray | None = None) -> np.ndarray:
    """Fast path: one contiguous read of a rank's shard of a group saved with the same members.

    Works for any world size or alignment as long as the group is unchanged (ValueError
    otherwise). Returns ``shard_numel`` float32 elements, padding zeroed.
    """
    ranges = rank_ranges(manifest.layout, partition, dp_rank)
    where = getattr(ranges, state)
    if where is None:
        raise CheckpointError(f"{ckpt_dir}: a weights-only checkpoint has no {state}")
    out = _output(out, partition.shard_numel)
    _pread_into(Path(ckpt_dir) / where.file, out[:ranges.numel], where.offset)
    out[ranges.numel:] = 0
    return out


def read_shard(ckpt_dir: str | os.PathLike, manifest: Manifest, partition: Partition,
               dp_rank: int, state: str = "master", *,
               out: np.ndarray | None = None) -> np.ndarray:
    """A rank's shard of a group under the current plan, whatever plan saved it.

    Uses ``read_range`` when the group was saved with the same members, else gathers each
    member slice with ``read_param``. Padding is zeroed.
    """
    if same_group(manifest.layout, partition):
        return read_range(ckpt_dir, manifest, partition, dp_rank, state, out=out)
    out = _output(out, partition.shard_numel)
    out[:] = 0
    for piece, offset in partition.rank_slices(dp_rank):
        read_param(ckpt_dir, manifest, piece.fqn, piece.start, piece.stop, state,
                   out=out[offset:offset + piece.numel])
    return out


def read_tensors(ckpt_dir: str | os.PathLike, manifest: Manifest,
                 state: str = "master") -> dict[str, np.ndarray]:
    """Every parameter's ``state`` reassembled to its full shape, fragments joined (export),
    and, for the master, every buffer."""
    buffers = manifest.layout.buffers if state == "master" else ()
    return {fqn: read_param(ckpt_dir, manifest, fqn, state=state).reshape(shape)
            for fqn, shape in manifest.layout.shapes + buffers}


def _output(out: np.ndarray | None, numel: int) -> np.ndarray:
    if out is None:
        return np.empty(numel, np.float32)
    if out.dtype != np.float32 or out.shape != (numel,) or not out.flags.c_contiguous:
        raise ValueError(f"out must be a contiguous float32 array of shape ({numel},), got "
                         f"{out.dtype} {out.shape}")
    return out


def _pread_into(path: Path, out: np.ndarray, offset: int) -> None:
    view = memoryview(out.view(np.uint8)).cast("B")
    fd = os.open(path, os.O_RDONLY)
    try:
        while view:
            got = os.preadv(fd, [view[:CHUNK]], offset)
            if got == 0:
                raise CheckpointError(f"{path}: truncated at byte {offset}")
            view, offset = view[got:], offset + got
    finally:
        os.close(fd)


# ---------------------------------------------------------------- verify


def verify(ckpt_dir: str | os.PathLike) -> list[str]:
    """Recompute every range checksum; one line per problem, in file order (empty if sound)."""
    root = Path(ckpt_dir)
    try:
        manifest = read_manifest(root)
    except CheckpointError as err:
        return [str(err)]
    problems = []
    for r in manifest.checksums:
        crc = _crc_range(root / r.file, r.offset, r.length)
        if crc != r.crc32:
            problems.append(f"{root}: {r.file} bytes [{r.offset}, {r.offset + r.length}): "
                            f"crc32 {crc:08x}, manifest says {r.crc32:08x}")
    try:
        if json.loads((root / INDEX_NAME).read_text()) != index_json(manifest.layout):
            problems.append(f"{root}: {INDEX_NAME} does not match the manifest")
    except (OSError, ValueError) as err:
        problems.append(f"{root}: {INDEX_NAME} is unreadable: {err}")
    return problems


def _crc_range(path: Path, offset: int, length: int) -> int:
    crc = 0
    with open(path, "rb") as f:
        for pos in range(offset, offset + length, CHUNK):
            crc = zlib.crc32(os.pread(f.fileno(), min(CHUNK, offset + length - pos), pos), crc)
    return crc


# ---------------------------------------------------------------- crash safety


def step_dir_name(step: int) -> str:
    """``step_00000050`` for step 50."""
    return f"step_{step:08d}"


def begin_save(root: str | os.PathLike, step: int) -> Path:
    """Create an empty ``root/step_XXXXXXXX.partial/`` (rank 0), removing a stale one."""
    partial = Path(root) / (step_dir_name(step) + PARTIAL)
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    return partial


def commit(partial_dir: str | os.PathLike, *, flushed: bool = False,
           layout: Layout | None = None) -> Path:
    """Publish a finished save: fsync files and dir, rename, then replace ``latest``.

    Refuses (CheckpointError) a directory whose manifest is missing or names a missing or
    truncated file. An existing checkpoint of the same step is replaced. ``flushed``: the
    caller already fsynced every file after its last write (each writer its own ranges, the
    header writer every file; the JSON files are always fsynced), so only the directories are.
    ``layout``: the layout whose manifest the caller has just written (``write_manifest``
    checked it), so the manifest is not parsed again; the files are still checked.

    Returns:
        The committed ``step_XXXXXXXX`` directory.
    """
    partial = Path(partial_dir)
    if not partial.name.endswith(PARTIAL):
        raise ValueError(f"{partial}: not a {PARTIAL} directory")
    if layout is None:
        read_manifest(partial)
    elif not (partial / MANIFEST_NAME).is_file():
        raise CheckpointError(f"{partial}: no {MANIFEST_NAME} (incomplete checkpoint)")
    else:
        for f in layout.files:
            _check_file(partial / f.name, f.size)
    for path in () if flushed else partial.iterdir():
        fsync_file(path)
    fsync_dir(partial)
    final, root = partial.with_name(partial.name[:-len(PARTIAL)]), partial.parent
    stale = root / (final.name + STALE)
    if final.exists():
        shutil.rmtree(stale, ignore_errors=True)
        (final / MANIFEST_NAME).unlink(missing_ok=True)  # incomplete before anything moves
        final.rename(stale)
    partial.rename(final)
    fsync_dir(root)
    _write_latest(root, final.name)
    shutil.rmtree(stale, ignore_errors=True)
    return final


def _write_latest(root: Path, name: str) -> None:
    tmp = root / "latest.tmp"
    tmp.write_text(name)
    fsync_file(tmp)
    os.replace(tmp, root / "latest")
    fsync_dir(root)


def find_latest(root: str | os.PathLike) -> Path | None:
    """The checkpoint to resume from: ``latest`` if it names a complete one, else the newest
    complete ``step_XXXXXXXX`` (valid manifest, every file present at its size).

    ``.partial`` directories and directories without a manifest are never returned.
    """
    root = Path(root)
    named = _latest_target(root)
    if named is not None and _is_complete(named):
        return named
    return next((p for p in _step_dirs(root) if _is_complete(p)), None)


def apply_retention(root: str | os.PathLike, keep_last: int, *,
                    committed: Path | None = None) -> list[Path]:
    """Delete complete checkpoints beyond the newest ``keep_last`` (never ``latest``'s target),
    and ``.partial``/``.stale`` directories older than the newest complete one.

    ``committed``: a step directory the caller has just committed, known complete (its
    manifest is not read again).

    Returns:
        The directories removed.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    root = Path(root)
    complete = [p for p in _step_dirs(root) if p == committed or _is_complete(p)]
    keep = set(complete[:keep_last]) | {_latest_target(root)}
    doomed = [p for p in complete if p not in keep]
    if complete:
        newest = _step_of(complete[0])
        doomed += [p for p in _step_dirs(root, suffixes=(PARTIAL, STALE)) if _step_of(p) < newest]
    for path in doomed:
        (path / MANIFEST_NAME).unlink(missing_ok=True)  # incomplete first, in case of a crash
        shutil.rmtree(path)
    return doomed


def _latest_target(root: Path) -> Path | None:
    try:
        name = (root / "latest").read_text().strip()
    except OSError:
        return None
    match = _STEP_DIR.fullmatch(name)
    return root / name if match and not match.group(2) else None


def _step_dirs(root: Path, suffixes: tuple[str | None, ...] = (None,)) -> list[Path]:
    """Step directories with one of ``suffixes`` (``None``: committed), newest first."""
    found = []
    for path in root.iterdir() if root.is_dir() else ():
        match = _STEP_DIR.fullmatch(path.name)
        if match and match.group(2) in suffixes and path.is_dir() and not path.is_symlink():
            found.append(path)
    return sorted(found, key=_step_of, reverse=True)


def _step_of(path: Path) -> int:
    return int(_STEP_DIR.fullmatch(path.name).group(1))


def _is_complete(path: Path) -> bool:
    try:
        return read_manifest(path).step == _step_of(path)
    except CheckpointError:
        return False


def find_checkpoint(path: str | os.PathLike) -> Path:
    """A step directory as given, or a checkpoint root's ``latest`` (newest complete one).

    Raises:
        CheckpointError: (one line) no such directory, or a root with no complete checkpoint.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    named = _STEP_DIR.fullmatch(path.name)
    if named and named.group(2):
        raise CheckpointError(f"{path}: an unfinished save ({named.group(2)}), never loaded")
    if named or (path / MANIFEST_NAME).exists():
        return path
    found = find_latest(path)
    if found is None:
        raise CheckpointError(f"{path}: no complete checkpoint (no step directory with a "
                              "valid manifest)")
    return found


def check_shapes(manifest, shapes: dict[str, tuple[int, ...]], where: Path) -> None:
    """CheckpointError (one line) unless the checkpoint holds exactly the model's params."""
    saved = dict(manifest.layout.shapes)
    for fqn, shape in shapes.items():
        if fqn not in saved:
            raise CheckpointError(f"{where}: parameter {fqn} is not in the checkpoint")
        if tuple(saved[fqn]) != tuple(shape):
            raise CheckpointError(f"{where}: parameter {fqn} has shape {tuple(saved[fqn])} in "
                                  f"the checkpoint, {tuple(shape)} in the model")
    extra = sorted(set(saved) - set(shapes))
    if extra:
        raise CheckpointError(f"{where}: the checkpoint has parameter {extra[0]} that the "
                              "model does not")
