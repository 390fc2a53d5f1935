"""Per-rank NVMe swap files: stable names and the folder that holds them.

``SwapDir`` names one rank's swap files from the optimizer group name and state (stable across
runs, never ``id()``), holds its folder under an ``flock`` for the job's lifetime (a second job
on the same path gets a folder of its own), checks free space before training and removes its
files at exit (docs/offload.md, "Swap files"). A swap file holds a contiguous partition range like the checkpoint
layout, so save/load are ``moezero.plan.store.copy_range`` file-to-file copies.
Reference counterpart: none (the reference keeps every state in memory).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import shutil
import socket
from pathlib import Path

from moezero.config import ConfigError
from moezero.offload.aio import OffloadIOError, aligned_size

__all__ = ["MAX_FOLDERS", "OPTIMIZER_KEY", "PARAM_KEY", "SwapDir", "swap_name"]

OPTIMIZER_KEY = "zero_optimization.offload_optimizer.nvme_path"
PARAM_KEY = "zero_optimization.offload_param.nvme_path"
SWAP_SUFFIX = ".swap"
LOCK_NAME = "lock"
MAX_FOLDERS = 64
"""Swap folders per rank and ``nvme_path`` (one per job running at once)."""

_STATE = re.compile(r"[a-z][a-z0-9_]*")
_PLAIN = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789.-")
_MAX_NAME = 200  # bytes of the encoded group name; file names are limited to 255


def swap_name(group_name: str, state: str) -> str:
    """File name of a state: ``moe/layer3/expert5/0`` -> ``moe__layer3__expert5__0.master.swap``.

    Deterministic and injective: "/" becomes "__"; an "_" next to another "_" or a "/",
    "%", a leading "." and any other character outside ``[A-Za-z0-9._-]`` are
    percent-encoded (UTF-8), so runs of underscores decode unambiguously. Names whose
    encoding exceeds 200 bytes keep a prefix and a "+" with a sha256 digest.
    """
    if not group_name or not _STATE.fullmatch(state):
        raise ValueError(f"swap file of group {group_name!r}, state {state!r}: need a non-empty "
                         "group name and a lowercase state name")
    enc = "".join(_encode(group_name, i) for i in range(len(group_name)))
    if len(enc) > _MAX_NAME:
        enc = enc[:_MAX_NAME - 17] + "+" + hashlib.sha256(group_name.encode()).hexdigest()[:16]
    return f"{enc}.{state}{SWAP_SUFFIX}"


def _encode(name: str, i: int) -> str:
    ch = name[i]
    if ch == "/":
        return "__"
    lonely = ch == "_" and name[i - 1:i] not in ("_", "/") and name[i + 1:i + 2] not in ("_", "/")
    if lonely or (ch in _PLAIN and not (ch == "." and i == 0)):
        return ch
    return "".join(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass"))


class SwapDir:
    """One rank's swap files in a folder this job holds: ``<nvme_path>/moezero-swap/
    rank<rank:05d>/<swap_name>`` (or ``rank<rank:05d>-<k>`` when other live jobs hold the
    first ones).

    ``acquire`` (called by the first ``path``/``allocate`` when not called before) takes an
    exclusive ``flock`` on the folder's ``lock`` file, held until ``release``/``cleanup`` or
    the process's end, so two jobs on one ``nvme_path`` never share files. A folder whose lock
    is free was left by a dead job: it is taken over and its swap files are reused (same
    names, overwritten in place) or removed (``prune``). Only ``*.swap`` files and the lock
    are ours; anything else there is left alone.
    """

    def __init__(self, nvme_path: str | os.PathLike, rank: int):
        self.root, self.rank = Path(nvme_path), rank
        self.folder = self._candidate(1)
        self._lock: int | None = None

    def _candidate(self, k: int) -> Path:
        name = f"rank{self.rank:05d}" + ("" if k == 1 else f"-{k}")
        return self.root / "moezero-swap" / name

    @property
    def held(self) -> bool:
        """This object holds its folder's lock."""
        return self._lock is not None

    def acquire(self) -> SwapDir:
        """Take the first folder no live job holds (creating it); OffloadIOError (one line)
        when ``MAX_FOLDERS`` are held. Idempotent."""
        if self._lock is not None:
            return self
        for k in range(1, MAX_FOLDERS + 1):
            fd = _try_lock(self._candidate(k))
            if fd is not None:
                self.folder, self._lock = self._candidate(k), fd
                return self
        raise OffloadIOError(f"{self.root / 'moezero-swap'}: all {MAX_FOLDERS} swap folders "
                             f"of rank {self.rank} are in use by running jobs")

    def release(self) -> None:
        """Let go of the folder's lock (its files stay for the next job to take over)."""
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def path(self, group_name: str, state: str) -> Path:
        """The file of ``state`` (``master``, ``exp_avg``, ``exp_avg_sq``, ``param``) of a group."""
        return self.acquire().folder / swap_name(group_name, state)

    def allocate(self, group_name: str, state: str, nbytes: int) -> Path:
        """Create or resize a swap file to ``aligned_size(nbytes)``, blocks reserved, never read.

        Raises OffloadIOError (one line) when the space cannot be reserved (ENOSPC, ...).
        """
        path, size = self.path(group_name, state), aligned_size(nbytes)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            if size:
                _reserve(fd, size, path)
        finally:
            os.close(fd)
        return path

    def prune(self, keep: set[str]) -> None:
        """Remove the held folder's swap files whose names are not in ``keep`` (a dead job's)."""
        for path, _ in self._ours():
            if path.name not in keep:
                path.unlink(missing_ok=True)

    def check(self, total_bytes: int, key: str = OPTIMIZER_KEY) -> None:
        """Can this job's swap files (``total_bytes``) fit? Writes nothing.

        ``total_bytes``: this rank's sum of ``aligned_size`` over its files. Free space counts,
        plus the swap files this job will overwrite or remove: those of its held folder or,
        before it holds one (the CLI's check before start), those of folders no live job
        holds. Other jobs' files do not count. Raises ConfigError (one line naming ``key`` and
        the path): missing, not a directory, not writable, or fewer free bytes than needed.
        """
        self.check_path(key)
        root = self.root
        free = shutil.disk_usage(root).free + self._reclaimable()
        if free < total_bytes:
            gib = lambda n: f"{n / (1 << 30):.2f} GiB"
            raise ConfigError(key, f"swap files need {total_bytes} bytes ({gib(total_bytes)}), "
                                   f"only {free} bytes ({gib(free)}) free", str(root))

    def check_path(self, key: str = OPTIMIZER_KEY) -> None:
        """ConfigError (one line naming ``key`` and the path) unless ``nvme_path`` is an
        existing, writable directory. Writes nothing."""
        root = self.root
        if not root.exists():
            raise ConfigError(key, "no such directory for swap files", str(root))
        if not root.is_dir():
            raise ConfigError(key, "not a directory", str(root))
        deepest = next(p for p in (self.folder, self.folder.parent, root) if p.is_dir())
        if not os.access(deepest, os.W_OK | os.X_OK):
            raise ConfigError(key, "swap directory is not writable", str(deepest))

    def _reclaimable(self) -> int:
        folders = [self.folder] if self.held else _unheld_folders(self.root / "moezero-swap")
        return sum(st.st_blocks * 512 for folder in folders for _, st in _swap_files(folder))

    def cleanup(self) -> None:
        """Remove our swap files and lock, then the folder and ``moezero-swap`` if left empty;
        release the lock. Only a holder removes anything."""
        if self._lock is None:
            return
        for path, _ in self._ours():
            path.unlink(missing_ok=True)
        (self.folder / LOCK_NAME).unlink(missing_ok=True)  # still held: nobody else is inside
        self.release()
        for folder in (self.folder, self.folder.parent):
            try:
                folder.rmdir()
            except OSError:  # absent, or holds files that are not ours
                return

    def listing(self) -> list[tuple[str, int]]:
        """``(name, size)`` of every regular file in the folder (but the lock), by name."""
        if not self.folder.is_dir():
            return []
        return sorted((e.name, e.stat().st_size) for e in os.scandir(self.folder)
                      if e.is_file(follow_symlinks=False) and e.name != LOCK_NAME)

    def _ours(self) -> list[tuple[Path, os.stat_result]]:
        return _swap_files(self.folder) if self.held else []


def _swap_files(folder: Path) -> list[tuple[Path, os.stat_result]]:
    if not folder.is_dir():
        return []
    return [(Path(e.path), e.stat()) for e in os.scandir(folder)
            if e.name.endswith(SWAP_SUFFIX) and e.is_file(follow_symlinks=False)]


def _try_lock(folder: Path) -> int | None:
    """An open descriptor holding ``folder/lock`` exclusively (the folder created if need
    be), or None when a live job holds it. Re-checks that the locked file is still the one
    at that path (a holder may have removed it on its way out) and retries if not."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
            return fd
        os.close(fd)
        folder.mkdir(parents=True, exist_ok=True)


def _unheld_folders(base: Path) -> list[Path]:
    """The folders under ``base`` whose lock no live job holds (probed, then let go)."""
    out = []
    for folder in sorted(base.iterdir()) if base.is_dir() else ():
        lock = folder / LOCK_NAME
        if not folder.is_dir() or not lock.exists():
            out += [folder] if folder.is_dir() else []
            continue
        try:
            fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:  # its job just removed it on the way out
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            out.append(folder)
        except BlockingIOError:
            pass
        finally:
            os.close(fd)
    return out


def _reserve(fd: int, size: int, path: Path) -> None:
    """Reserve the blocks now, so a full disk fails here and not mid-training."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as err:
        if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise OffloadIOError(f"{path}: cannot reserve {size} bytes: "
                                 f"{os.strerror(err.errno)}") from err
