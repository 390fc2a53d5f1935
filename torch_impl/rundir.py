"""The run directory and the checkpoint root, checked before a run's first step, and the lock
that keeps one run per run directory (docs/reliability.md).

``check_run`` is what the CLI calls before any rank starts: the run directory (``--out``) and
``checkpoint.dir`` can be created and written (a probe file is created, fsynced and removed
on each, and folders the probe created are removed again), the checkpoint root has room for
``keep_last + 1`` checkpoints (``checkpoint_bytes`` each; a save writes the newest before it
deletes the oldest), and no live run holds the run directory. ``RunLock``
is the lock itself: rank 0 holds an ``flock`` on ``<run dir>/.moezero.lock`` for its
lifetime and removes the file when it lets go (the kernel lets go of the lock when the process
ends, so a crashed run never blocks the next). ``RootLock`` covers ``checkpoint.dir`` the same
way (an ``flock`` on the directory itself, so the root holds nothing but checkpoints): two
runs with their own ``--out`` and one ``checkpoint.dir`` would delete each other's
checkpoints.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import socket
from pathlib import Path

from moezero.config import ConfigError
from moezero.distributed.agree import broadcast_json
from moezero.distributed.failures import RankFailure, describe
from moezero.plan.store import CheckpointError, complete_steps

__all__ = ["LOCK_NAME", "RootLock", "RunLock", "agree_run_dir", "check_run", "checkpoint_bytes", "probe_writable"]

LOCK_NAME = ".moezero.lock"
HEADER_BYTES = 256
"""Allowance per tensor and state in a checkpoint's safetensors headers and manifest."""
JSON_BYTES = 1 << 20
"""Allowance for a checkpoint's manifest, index and per-rank state beyond the tensors."""
_STEP = re.compile(r"step_\d{8,}")


def checkpoint_bytes(numel: int, num_tensors: int) -> int:
    """Bytes of one checkpoint of a model of ``numel`` elements in ``num_tensors`` tensors:
    the fp32 master and two fp32 moments of each element, plus headers and JSON."""
    return 12 * numel + 3 * HEADER_BYTES * num_tensors + JSON_BYTES


def probe_writable(path: Path, key: str) -> None:
    """Create ``path`` (and its missing parents), write, fsync and remove a probe file in
    it, then remove the folders this created. ConfigError (one line naming ``key`` and the
    path) on any failure."""
    path = Path(os.path.abspath(path))
    created = [p for p in (path, *path.parents) if not os.path.lexists(p)]
    try:
        _probe(path)
    except OSError as exc:
        raise ConfigError(key, f"cannot write there: {exc.strerror or exc}",
                          exc.filename or str(path)) from None
    finally:
        for folder in created:  # deepest first; only what is still empty
            try:
                folder.rmdir()
            except OSError:
                break


def _probe(path: Path, attempts: int = 5) -> None:
    """Write, fsync and remove ``path/.moezero-probe-<pid>`` (creating ``path``). Retried when
    the folder vanishes in between: torchrun's workers probe the same new folders at once,
    and one may remove a folder it created while another is about to write in it."""
    probe = path / f".moezero-probe-{os.getpid()}"
    for attempt in range(attempts):
        path.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileNotFoundError:
            if attempt == attempts - 1:
                raise
            continue
        try:
            os.write(fd, b"moezero")
            os.fsync(fd)
        finally:
            os.close(fd)
        probe.unlink()
        return


def _check_free(path: Path, one: int, keep_last: int, key: str) -> None:
    """ConfigError unless the filesystem of ``path`` (or its nearest existing parent) has
    room for ``keep_last + 1`` checkpoints of ``one`` bytes (a save writes the newest while
    the oldest kept one still exists), less those the root already holds."""
    path = Path(os.path.abspath(path))
    held = min(keep_last, _held(path))
    need = one * (keep_last + 1 - held)
    free = shutil.disk_usage(next(p for p in (path, *path.parents) if p.exists())).free
    if free < need:
        gib = lambda n: f"{n / (1 << 30):.2f} GiB"
        less = f" less the {held} it holds" if held else ""
        raise ConfigError(key, f"one checkpoint needs {one} bytes ({gib(one)}); keep_last "
                               f"{keep_last} + 1{less}: {need} bytes ({gib(need)}), only "
                               f"{free} bytes ({gib(free)}) free", str(path))


def _held(root: Path) -> int:
    """Committed step directories in ``root``."""
    return sum(1 for p in root.iterdir() if _STEP.fullmatch(p.name)) if root.is_dir() else 0


def check_run(run_dir: Path, ckpt_root: Path, ckpt_bytes: int, *, lock: bool = True,
              keep_last: int = 1, resumes: Path | None = None) -> None:
    """Before any rank starts: the run directory and checkpoint root are writable, the root
    has room for ``keep_last + 1`` checkpoints of ``ckpt_bytes`` (less those it holds), and
    (with ``lock``) no live run holds the run directory or the root, and the root holds no
    other run's checkpoints (``check_root_owner``; ``resumes``: the step directory the run
    resumes from). One-line ConfigError; leaves the filesystem as it found it. ``lock``
    False: a torchrun worker other than rank 0 (rank 0 may already hold the lock of this very
    run, and be saving in its root)."""
    probe_writable(run_dir, "--out")
    probe_writable(ckpt_root, "checkpoint.dir")
    _check_free(ckpt_root, ckpt_bytes, keep_last, "checkpoint.dir")
    if lock and (Path(run_dir) / LOCK_NAME).exists():
        RunLock(run_dir).acquire().release()
    if lock and Path(ckpt_root).is_dir():
        RootLock(ckpt_root).acquire().release()
        check_root_owner(ckpt_root, resumes)


def check_root_owner(root: Path, resumes: Path | None) -> None:
    """A run writes into (and prunes) only a checkpoint root it creates or resumes from: a
    root holding complete checkpoints is refused unless ``resumes`` (the step directory the
    run loads) lies in it. One-line CheckpointError naming the root and its newest one."""
    if resumes is not None and Path(resumes).resolve().parent == Path(root).resolve():
        return
    held = complete_steps(root)
    if held:
        raise CheckpointError(f"checkpoint.dir: {root} holds the checkpoints of another run "
                          f"({held[0].name}): a run writes only into a checkpoint root it "
                          "creates or resumes from; resume that run with --set "
                          "checkpoint.load=latest, or give this run its own --out (or "
                          "checkpoint.dir)")


def agree_run_dir(proposed: str | os.PathLike, *, rank: int, device,
                  ckpt_root: str | os.PathLike | None = None) -> tuple[Path, RunLock | None]:
    """Rank 0's run directory on every rank, locked by rank 0 with its checkpoint root
    ``ckpt_root`` (collective: one broadcast, the one that already carried the directory).
    Every rank raises ``RankFailure`` (one line; no log is written into a directory another
    run holds) when rank 0 cannot lock them.

    Returns:
        The run directory, and on rank 0 the held ``RunLock`` (None elsewhere).
    """
    lock, error = None, None
    if rank == 0:
        try:
            lock = RunLock(proposed).acquire()
            lock.root = RootLock(ckpt_root).acquire() if ckpt_root is not None else None
        except (ConfigError, OSError) as exc:
            error = f"rank 0: {describe(exc)}"
            if lock is not None:
                lock.release()
                lock = None
    agreed = broadcast_json({"run_dir": os.fspath(proposed), "error": error}, device=device)
    if agreed["error"]:
        raise RankFailure(agreed["error"])
    return Path(agreed["run_dir"]), lock


class RunLock:
    """An exclusive ``flock`` on ``<run dir>/.moezero.lock``, held by one process (rank 0)
    while its run lasts; the file records the holder and is removed on release (a clean
    finish, an error, SIGTERM's save-and-exit; a killed process leaves it, unlocked, and the
    next run takes it over)."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: int | None = None
        self.root: RootLock | None = None  # the run's checkpoint root, released with it

    def acquire(self) -> RunLock:
        """Take the lock (creating the run directory); ConfigError (one line naming the
        directory and the holder) when another live run holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
                os.close(fd)
                raise ConfigError("--out", f"the run directory is in use by a running job "
                                           f"({holder}); give each run its own --out",
                                  str(self.path.parent)) from None
            if self._is_current(fd):
                break
            os.close(fd)  # its holder released (and removed) the file we opened: open anew
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        return self

    def _is_current(self, fd: int) -> bool:
        """Whether ``fd`` is still the file at ``self.path`` (not one a releaser unlinked)."""
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            return False
        held = os.fstat(fd)
        return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)

    def release(self) -> None:
        """Remove the lock file, then let go (a waiter that opened it opens the path anew);
        the checkpoint root's lock is let go first."""
        if self.root is not None:
            self.root.release()
        if self._fd is not None:
            if self._is_current(self._fd):
                self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


class RootLock:
    """An exclusive ``flock`` on a checkpoint root directory itself (no file in it), held by
    rank 0 while its run lasts: one run writes and prunes a root at a time."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self._fd: int | None = None
        self._made = False

    def acquire(self) -> RootLock:
        """Take the lock (creating the root, removed again at release if still empty);
        ConfigError (one line naming it) when another live run holds it."""
        self._made = not self.root.exists()
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError("checkpoint.dir", "the checkpoint root is in use by a running "
                                                "job; give each run its own checkpoint.dir",
                              str(self.root)) from None
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            if self._made:  # a run that saved nothing leaves no empty root behind
                with contextlib.suppress(OSError):
                    self.root.rmdir()
