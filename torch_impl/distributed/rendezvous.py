"""The spawned ranks' rendezvous folder: a fresh temporary folder per job, never left behind.

The launcher creates ``<tmp>/moezero-rdzv-*`` and removes it on every way out it lives through
(``folder``). Every process of the job holds a shared ``flock`` on its ``owner.lock`` (the
launcher, and each rank through ``hold``), so a folder whose lock can be taken exclusively
belongs to a job with no live process left (a launcher killed with SIGKILL, whose ranks then
saved and exited): the next start removes it (``remove_stale``). ``Flag`` is the launcher's
preemption request to its ranks: a file there, not a ``multiprocessing.Event`` (whose named
semaphores a killed process leaks, with a warning from the resource tracker).
"""

from __future__ import annotations

import fcntl
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

__all__ = ["PREFIX", "Flag", "folder", "hold", "remove_stale"]

PREFIX = "moezero-rdzv-"
LOCK_NAME = "owner.lock"
UNLOCKED_AGE_S = 86400.0
"""A folder without a lock file (an older version's) is removed once this old. ``folder``
takes its lock under a hidden name first, so a new folder never looks unheld."""


class Flag:
    """A flag the launcher sets and every rank reads: a file in the rendezvous folder."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def set(self) -> None:
        self.path.touch()

    def is_set(self) -> bool:
        return self.path.exists()


def hold(path: str | Path) -> IO:
    """A shared lock on the folder ``path`` for as long as the returned file stays open."""
    lock = open(Path(path, LOCK_NAME), "a")  # held until closed
    fcntl.flock(lock, fcntl.LOCK_SH)
    return lock


def _unused(path: Path) -> bool:
    """No process holds ``path``'s lock (without a lock: it is older than a day)."""
    try:
        if not (path / LOCK_NAME).exists():
            return time.time() - path.stat().st_mtime > UNLOCKED_AGE_S
        with open(path / LOCK_NAME, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
    except OSError:  # held (BlockingIOError), gone, or not ours to open
        return False


def remove_stale(root: str | Path | None = None) -> list[Path]:
    """Remove the rendezvous folders under ``root`` (the temporary directory) that no live
    process holds; returns them."""
    removed = []
    for path in Path(root or tempfile.gettempdir()).glob(f"{PREFIX}*"):
        if path.is_dir() and _unused(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


@contextmanager
def folder() -> Iterator[Path]:
    """A fresh rendezvous folder, held by this process, removed on the way out (stale ones
    are removed first)."""
    remove_stale()
    staging = Path(tempfile.mkdtemp(prefix=f".{PREFIX}"))  # locked before it can look stale
    lock = hold(staging)
    path = staging.with_name(staging.name.removeprefix("."))
    staging.rename(path)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        lock.close()
