"""The ``--out`` folder of ``moezero prepare-data``: held by one run, written in place.

``--out`` may be a new path or an existing empty directory, including a symlink to one or an
empty mount point, neither of which can be removed or renamed over: the dataset is therefore
written into ``OUT`` itself, never renamed onto it. ``OutFolder.open`` creates ``OUT`` when it
is missing, takes an exclusive ``flock`` on ``OUT/.moezero-prepare.lock`` (a second run on the
same ``--out`` is refused in one line at its start) and checks, under the lock, that ``OUT``
holds nothing else. The files are written under ``OUT/.partial`` (one left by a killed run is
removed) and moved up by ``commit``, the manifest last: ``OUT`` is a dataset only once its
manifest is there. ``discard`` leaves ``OUT`` as it was found (removed when this run made it).
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path
from typing import IO

from moezero.data.common import DataError

__all__ = ["OutFolder"]

LOCK = ".moezero-prepare.lock"
STAGING = ".partial"


class OutFolder:
    """``--out`` of one prepare-data run, locked from ``open`` to ``commit`` or ``discard``."""

    def __init__(self, out: Path, lock: IO, made: bool):
        self.out, self._lock, self.made = out, lock, made
        self.staging = out / STAGING

    @classmethod
    def open(cls, out: str | Path) -> OutFolder:
        """Lock ``out`` (made when missing) and give it an empty staging folder.

        Raises:
            DataError: (one line) ``out`` is not a directory, not empty, or being written by
                another prepare-data run.
        """
        out = Path(out)
        if out.exists() and not out.is_dir():
            raise DataError(f"--out {out}: exists and is not a directory")
        made = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        lock = open(out / LOCK, "a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise DataError(f"--out {out}: another prepare-data run is writing it (it holds "
                            f"{out / LOCK}); wait for it to end or give another --out") from None
        folder = cls(out, lock, made)
        others = sorted(p.name for p in out.iterdir() if p.name not in (LOCK, STAGING))
        if others:
            folder._release()
            raise DataError(f"--out {out}: exists and is not an empty directory (it holds "
                            f"{others[0]}{' and more' if len(others) > 1 else ''})")
        shutil.rmtree(folder.staging, ignore_errors=True)  # left by a killed run
        folder.staging.mkdir()
        return folder

    def commit(self, manifest_name: str) -> None:
        """Flush every staged file, move each into ``out`` (``manifest_name`` last), release."""
        names = sorted(os.listdir(self.staging), key=lambda n: n == manifest_name)
        for name in names:
            with open(self.staging / name, "rb") as f:
                os.fsync(f.fileno())
        for name in names:
            os.replace(self.staging / name, self.out / name)
        self.staging.rmdir()
        _fsync_dir(self.out)
        self._release()

    def discard(self) -> None:
        """Remove what this run wrote (``out`` too when this run made it) and release."""
        shutil.rmtree(self.staging, ignore_errors=True)
        self._release()
        if self.made:
            try:
                self.out.rmdir()
            except OSError:  # another run's lock file arrived meanwhile: its folder now
                pass

    def _release(self) -> None:
        """Remove the lock file while holding it, then drop it."""
        if self._lock.closed:
            return
        try:
            (self.out / LOCK).unlink()
        except FileNotFoundError:
            pass
        self._lock.close()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
