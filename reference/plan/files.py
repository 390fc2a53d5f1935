"""File primitives of the checkpoint store: chunked positional I/O, flushes, atomic JSON.

Shared by the writer (``moezero.plan.store``), the reader (``moezero.plan.reading``) and the
step directories' life cycle (``moezero.plan.stepdirs``); no layout knowledge here.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import numpy as np

from moezero.plan.bytes_io import CHUNK


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message is one line naming the file."""


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """``os.pwrite`` all of ``view`` at ``offset`` (a short write continues)."""
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def pread_into(path: Path, out: np.ndarray, offset: int) -> None:
    """Fill ``out`` from ``path`` at ``offset``, ``CHUNK`` bytes per read; CheckpointError
    naming the byte where the file ends early."""
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


def read_json(path: Path, missing: str) -> object:
    """The JSON at ``path``; CheckpointError ``missing`` when there is no such file, else one
    line naming the file when it cannot be read or parsed."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(missing) from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: unreadable: {' '.join(str(err).split())}") from None


def write_json(path: Path, obj: object) -> None:
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


def check_file(path: Path, size: int) -> None:
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
