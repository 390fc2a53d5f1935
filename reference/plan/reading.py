"""Reading a checkpoint: the manifest (checked), resharding reads by FQN or by partition,
checksum verification, and the model-shape check.

``read_shard`` gives a rank its shard of a group under the current plan whatever plan saved
it: one contiguous read (``read_range``) when the group is unchanged, else per-member slices
(``read_param``). Names in a manifest never escape its directory. Torch counterpart:
``moezero.checkpoint.core`` (loads through these); writing is ``moezero.plan.store``.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from pathlib import Path

import numpy as np

from moezero.plan.files import CHUNK, CheckpointError, check_file, pread_into, read_json
from moezero.plan.layout import (
    INDEX_NAME,
    ITEMSIZE,
    MANIFEST_NAME,
    FileLayout,
    index_json,
    rank_ranges,
    same_group,
)
from moezero.plan.manifest import Manifest, manifest_from_json
from moezero.plan.partition import Partition
from moezero.plan.rules import MASTER


def read_manifest(ckpt_dir: str | os.PathLike) -> Manifest:
    """Read and check a checkpoint's manifest; every file must exist with its size.

    Raises:
        CheckpointError: (one line) no/unreadable manifest, a file named outside the
            directory (absolute, ``..``, symlink escaping), a manifest inconsistent with
            its layout, or a missing/truncated file (named).
    """
    root = Path(ckpt_dir)
    path = root / MANIFEST_NAME
    obj = read_json(path, f"{root}: no {MANIFEST_NAME} (incomplete checkpoint)")
    base = os.path.realpath(root)
    for name in _named_files(obj):
        _resolve(root, name, base)
    try:
        manifest = manifest_from_json(obj)
    except ValueError as err:
        raise CheckpointError(f"{path}: {err}") from None
    for f in manifest.layout.files:
        check_file(root / f.name, f.size)
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


def read_param(ckpt_dir: str | os.PathLike, manifest: Manifest, fqn: str, start: int = 0,
               stop: int | None = None, state: str = MASTER, *,
               out: np.ndarray | None = None, reader=None) -> np.ndarray:
    """Elements ``[start, stop)`` of flattened parameter ``fqn``'s ``state``, from any plan.

    Gathers from every file and fragment that holds part of the range (one ``pread`` per
    piece). ``stop=None`` means the end. Returns a 1-D float32 array (``out`` if given).
    ``reader``: reads the bytes instead of a plain ``pread`` (``checked.CheckedReader``
    verifies every range it touches).
    """
    pieces = manifest.layout.pieces(fqn, state)
    numel = math.prod(manifest.layout.shape(fqn))
    stop = numel if stop is None else stop
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"param {fqn!r}: range [{start}, {stop}) is outside [0, {numel})")
    out = _output(out, stop - start)
    if not pieces:  # a moment of a param saved frozen
        out[:] = 0
    for f, t in pieces:
        lo, hi = max(start, t.start), min(stop, t.stop)
        if lo < hi:
            offset = f.data_start + t.begin + (lo - t.start) * f.itemsize
            _read(reader, ckpt_dir, f, out[lo - start:hi - start], offset)
    return out


def read_range(ckpt_dir: str | os.PathLike, manifest: Manifest, partition: Partition,
               dp_rank: int, state: str = MASTER, *, out: np.ndarray | None = None,
               reader=None, span: tuple[int, int] | None = None) -> np.ndarray:
    """Fast path: one contiguous read of a rank's shard of a group saved with the same members.

    Works for any world size or alignment as long as the group is unchanged (ValueError
    otherwise). Returns ``shard_numel`` float32 elements, padding zeroed; with ``span``
    ``(lo, hi)`` only those elements of the shard (``hi - lo``), read alone.
    """
    ranges = rank_ranges(manifest.layout, partition, dp_rank)
    where = getattr(ranges, state)
    if where is None:
        raise CheckpointError(f"{ckpt_dir}: a weights-only checkpoint has no {state}")
    lo, hi = _span(span, partition)
    out = _output(out, hi - lo)
    real = max(lo, min(hi, ranges.numel))
    if real > lo:
        f = manifest.layout.file(where.file)
        _read(reader, ckpt_dir, f, out[:real - lo], where.offset + lo * f.itemsize)
    out[real - lo:] = 0
    return out


def read_shard(ckpt_dir: str | os.PathLike, manifest: Manifest, partition: Partition,
               dp_rank: int, state: str = MASTER, *, out: np.ndarray | None = None,
               reader=None, span: tuple[int, int] | None = None) -> np.ndarray:
    """A rank's shard of a group under the current plan, whatever plan saved it.

    Uses ``read_range`` when the group was saved with the same members, else gathers each
    member slice with ``read_param``. Padding is zeroed. ``reader`` as in ``read_param``.
    ``span`` ``(lo, hi)``: elements ``[lo, hi)`` of the shard only, reading nothing else (a
    caller streams a shard through a bounded buffer).
    """
    if same_group(manifest.layout, partition):
        return read_range(ckpt_dir, manifest, partition, dp_rank, state, out=out,
                          reader=reader, span=span)
    lo, hi = _span(span, partition)
    out = _output(out, hi - lo)
    out[:] = 0
    for piece, at in partition.rank_slices(dp_rank):
        a, b = max(lo, at), min(hi, at + piece.numel)
        if a < b:
            read_param(ckpt_dir, manifest, piece.fqn, piece.start + a - at,
                       piece.start + b - at, state, out=out[a - lo:b - lo], reader=reader)
    return out


def _span(span: tuple[int, int] | None, partition: Partition) -> tuple[int, int]:
    lo, hi = span or (0, partition.shard_numel)
    if not 0 <= lo <= hi <= partition.shard_numel:
        raise ValueError(f"{partition.group}: span [{lo}, {hi}) is outside the "
                         f"{partition.shard_numel}-element shard")
    return lo, hi


def read_tensors(ckpt_dir: str | os.PathLike, manifest: Manifest,
                 state: str = MASTER, *, reader=None) -> dict[str, np.ndarray]:
    """Every parameter's ``state`` reassembled to its full shape, fragments joined (export),
    and, for the master, every buffer. ``reader`` as in ``read_param`` (export passes a
    ``checked.CheckedReader``: every byte verified)."""
    buffers = manifest.layout.buffers if state == MASTER else ()
    return {fqn: read_param(ckpt_dir, manifest, fqn, state=state, reader=reader).reshape(shape)
            for fqn, shape in manifest.layout.shapes + buffers}


def _read(reader, ckpt_dir, f: FileLayout, out: np.ndarray, offset: int) -> None:
    """``out`` (float32) from file ``f`` at ``offset``: through ``reader`` when given, else a
    plain ``pread``; a BF16 or F16 file's elements are read raw, then upcast exactly."""
    raw = out if f.itemsize == ITEMSIZE else np.empty(out.size, np.uint16)
    if reader is None:
        pread_into(Path(ckpt_dir) / f.name, raw, offset)
    else:
        reader.read_into(f.name, raw, offset)
    if raw is not out:
        upcast_into(raw, f.dtype, out)


def upcast_into(raw: np.ndarray, dtype: str, out: np.ndarray) -> None:
    """The float32 values of ``raw`` (uint16 bit patterns of ``dtype`` ``BF16`` or ``F16``)
    into ``out``: exact (bf16 is the top half of an fp32; fp16 widens without rounding)."""
    if dtype == "BF16":
        np.left_shift(raw.astype(np.uint32), 16, out=out.view(np.uint32))
    else:
        out[:] = raw.view(np.float16)


def _output(out: np.ndarray | None, numel: int) -> np.ndarray:
    if out is None:
        return np.empty(numel, np.float32)
    if out.dtype != np.float32 or out.shape != (numel,) or not out.flags.c_contiguous:
        raise ValueError(f"out must be a contiguous float32 array of shape ({numel},), got "
                         f"{out.dtype} {out.shape}")
    return out


def verify(ckpt_dir: str | os.PathLike, *, chunk: int = CHUNK) -> list[str]:
    """Recompute every range checksum, reading ``chunk`` bytes at a time; one line per
    problem, in file order (empty if sound)."""
    root = Path(ckpt_dir)
    try:
        manifest = read_manifest(root)
    except CheckpointError as err:
        return [str(err)]
    problems = []
    for r in manifest.checksums:
        crc = _crc_range(root / r.file, r.offset, r.length, chunk)
        if crc != r.crc32:
            problems.append(f"{root}: {r.file} bytes [{r.offset}, {r.offset + r.length}): "
                            f"crc32 {crc:08x}, manifest says {r.crc32:08x}")
    try:
        if json.loads((root / INDEX_NAME).read_text()) != index_json(manifest.layout):
            problems.append(f"{root}: {INDEX_NAME} does not match the manifest")
    except (OSError, ValueError) as err:
        problems.append(f"{root}: {INDEX_NAME} is unreadable: {err}")
    return problems


def _crc_range(path: Path, offset: int, length: int, chunk: int = CHUNK) -> int:
    crc = 0
    with open(path, "rb") as f:
        for pos in range(offset, offset + length, chunk):
            crc = zlib.crc32(os.pread(f.fileno(), min(chunk, offset + length - pos), pos), crc)
    return crc


def check_shapes(manifest, shapes: dict[str, tuple[int, ...]], where: Path, *,
                 exact: bool = True) -> None:
    """CheckpointError (one line) unless the checkpoint holds exactly the model's params (with
    ``exact=False``: at least ``shapes``, as a base checkpoint holds the frozen ones)."""
    saved = dict(manifest.layout.shapes)
    for fqn, shape in shapes.items():
        if fqn not in saved:
            raise CheckpointError(f"{where}: parameter {fqn} is not in the checkpoint")
        if tuple(saved[fqn]) != tuple(shape):
            raise CheckpointError(f"{where}: parameter {fqn} has shape {tuple(saved[fqn])} in "
                                  f"the checkpoint, {tuple(shape)} in the model")
    extra = sorted(set(saved) - set(shapes))
    if extra and exact:
        raise CheckpointError(f"{where}: the checkpoint has parameter {extra[0]} that the "
                              "model does not")
