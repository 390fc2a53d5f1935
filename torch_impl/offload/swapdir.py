"""Per-rank NVMe swap files: stable names and the folder that holds them.

``SwapDir`` names one rank's swap files from the optimizer group name and state (stable across
runs, never ``id()``), checks free space before training and removes its files at exit
(DESIGN.md §1.4, §3). A swap file holds a contiguous partition range like the checkpoint
layout, so save/load are ``moezero.plan.store.copy_range`` file-to-file copies.
Reference counterpart: none (the reference keeps every state in memory).
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
from pathlib import Path

from moezero.config import ConfigError
from moezero.offload.aio import OffloadIOError, aligned_size

__all__ = ["OPTIMIZER_KEY", "PARAM_KEY", "SwapDir", "swap_name"]

OPTIMIZER_KEY = "zero_optimization.offload_optimizer.nvme_path"
PARAM_KEY = "zero_optimization.offload_param.nvme_path"
SWAP_SUFFIX = ".swap"

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
    """One rank's swap files, ``<nvme_path>/moezero-swap/rank<rank:05d>/<swap_name>``.

    Sized to multiples of ``ALIGN``, overwritten in place by later runs. Only ``*.swap`` files
    in the rank folder are ours; anything else there is left alone.
    """

    def __init__(self, nvme_path: str | os.PathLike, rank: int):
        self.root = Path(nvme_path)
        self.folder = self.root / "moezero-swap" / f"rank{rank:05d}"

    def path(self, group_name: str, state: str) -> Path:
        """The file of ``state`` (``master``, ``exp_avg``, ``exp_avg_sq``, ``param``) of a group."""
        return self.folder / swap_name(group_name, state)

    def allocate(self, group_name: str, state: str, nbytes: int) -> Path:
        """Create or resize a swap file to ``aligned_size(nbytes)``, blocks reserved, never read.

        Raises OffloadIOError (one line) when the space cannot be reserved (ENOSPC, ...).
        """
        path, size = self.path(group_name, state), aligned_size(nbytes)
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            if size:
                _reserve(fd, size, path)
        finally:
            os.close(fd)
        return path

    def check(self, total_bytes: int, key: str = OPTIMIZER_KEY) -> None:
        """Before training: can the folder hold ``total_bytes`` of swap files? Writes nothing.

        ``total_bytes``: this rank's sum of ``aligned_size`` over its files. Our ``*.swap``
        files already there count as free (they get overwritten); foreign ones do not.
        Raises ConfigError (one line naming ``key`` and the path): missing, not a directory,
        not writable, or fewer free bytes than needed.
        """
        root = self.root
        if not root.exists():
            raise ConfigError(key, "no such directory for swap files", str(root))
        if not root.is_dir():
            raise ConfigError(key, "not a directory", str(root))
        deepest = next(p for p in (self.folder, self.folder.parent, root) if p.is_dir())
        if not os.access(deepest, os.W_OK | os.X_OK):
            raise ConfigError(key, "swap directory is not writable", str(deepest))
        free = shutil.disk_usage(root).free + sum(s.st_blocks * 512 for _, s in self._ours())
        if free < total_bytes:
            gib = lambda n: f"{n / (1 << 30):.2f} GiB"
            raise ConfigError(key, f"swap files need {total_bytes} bytes ({gib(total_bytes)}), "
                                   f"only {free} bytes ({gib(free)}) free", str(root))

    def cleanup(self) -> None:
        """Remove our swap files, then the rank folder and ``moezero-swap`` if left empty."""
        for path, _ in self._ours():
            path.unlink(missing_ok=True)
        for folder in (self.folder, self.folder.parent):
            try:
                folder.rmdir()
            except OSError:  # absent, or holds files that are not ours
                return

    def listing(self) -> list[tuple[str, int]]:
        """``(name, size)`` of every regular file in the rank folder, sorted by name."""
        if not self.folder.is_dir():
            return []
        return sorted((e.name, e.stat().st_size) for e in os.scandir(self.folder)
                      if e.is_file(follow_symlinks=False))

    def _ours(self) -> list[tuple[Path, os.stat_result]]:
        if not self.folder.is_dir():
            return []
        return [(Path(e.path), e.stat()) for e in os.scandir(self.folder)
                if e.name.endswith(SWAP_SUFFIX) and e.is_file(follow_symlinks=False)]


def _reserve(fd: int, size: int, path: Path) -> None:
    """Reserve the blocks now, so a full disk fails here and not mid-training."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as err:
        if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise OffloadIOError(f"{path}: cannot reserve {size} bytes: "
                                 f"{os.strerror(err.errno)}") from err
