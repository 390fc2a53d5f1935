"""NVMe offload I/O: aligned host buffers, an async file-I/O engine, per-rank swap files.

``AsyncIO`` splits each request into 8 MiB chunks that a thread pool moves with ``preadv`` /
``pwritev``; aligned chunks (address, offset, length multiples of ``ALIGN``) use O_DIRECT, so
swap traffic neither fills nor is flattered by the page cache. O_DIRECT is probed once per
directory; where it is refused (FUSE, tmpfs before Linux 6.6, ...) I/O there is buffered and
the reason logged once on ``moezero.offload``. CUDA tensors use GPUDirect Storage
(``torch.cuda.gds``) when cuFile works, else a pinned host buffer: neither runs without a GPU,
so both are small and guarded. ``SwapDir`` names one rank's swap files from the optimizer group
name and state (stable across runs, never ``id()``), checks free space before training and
removes its files at exit (DESIGN.md §1.4, §3). Reference counterpart: none (the reference
keeps every state in memory); a swap file holds a contiguous partition range like the
checkpoint layout, so save/load are ``moezero.plan.store.copy_range`` file-to-file copies.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from moezero.config import ConfigError

__all__ = ["ALIGN", "CHUNK", "OPTIMIZER_KEY", "PARAM_KEY", "AsyncIO", "OffloadIOError",
           "SwapDir", "aligned_empty", "aligned_size", "swap_name"]

ALIGN = 4096  # O_DIRECT granularity of buffer address, file offset and length (512e and 4Kn)
CHUNK = 8 << 20  # bytes per preadv/pwritev call, the unit spread over the workers
OPTIMIZER_KEY = "zero_optimization.offload_optimizer.nvme_path"
PARAM_KEY = "zero_optimization.offload_param.nvme_path"
SWAP_SUFFIX = ".swap"
log = logging.getLogger("moezero.offload")


class OffloadIOError(OSError):
    """A failed swap transfer, one line: ``<path>: <op> of bytes [a, b) failed: <why>``."""


def aligned_size(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of ``ALIGN``."""
    return -(-nbytes // ALIGN) * ALIGN


def aligned_empty(numel: int, dtype: torch.dtype, *, pin: bool = False) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor starting on a 4096-byte boundary (an O_DIRECT buffer).

    Its storage runs ``aligned_size(nbytes)`` past the start. ``pin`` page-locks it only when
    CUDA is available (CPU builds of torch refuse ``pin_memory``); otherwise it is ignored.
    """
    nbytes = aligned_size(numel * dtype.itemsize)
    pin = pin and torch.cuda.is_available()
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    start = -raw.data_ptr() % ALIGN
    return raw[start:start + nbytes].view(dtype)[:numel]


# ---------------------------------------------------------------- the I/O engine


@dataclass
class _File:
    """The cached descriptors of one path: buffered, and O_DIRECT when the directory allows."""

    fd: int
    dfd: int | None
    folder: str
    direct: bool = False  # dfd is usable (cleared if the filesystem refuses it later)


class _Request:
    """One read/write split into pieces; the last piece to finish resolves the future."""

    def __init__(self, span: str, pieces: int, nbytes: int, finish: list[Callable[[], object]]):
        self.future: Future = Future()
        self.future.set_running_or_notify_cancel()  # cannot be cancelled half-written
        self.span, self.nbytes, self._finish = span, nbytes, finish
        self._left, self._error, self._lock = max(pieces, 1), None, threading.Lock()
        if not pieces:
            self.piece_done(None)

    def piece_done(self, error: BaseException | None) -> None:
        with self._lock:
            self._error = self._error or error
            self._left -= 1
            if self._left:
                return
        try:
            for step in self._finish if self._error is None else ():
                step()
        except Exception as err:  # fsync or copy-back: reported like the I/O itself
            self._error = err
        if self._error is None:
            self.future.set_result(self.nbytes)
        else:
            exc = OffloadIOError(f"{self.span}: {self._error}".replace("\n", " "))
            exc.__cause__ = self._error
            self.future.set_exception(exc)


class AsyncIO:
    """Thread pool of ``preadv``/``pwritev`` over descriptors cached per path until ``close``.

    Thread-safe. Requests run concurrently and complete in any order: until a future is done,
    leave its buffer and file range alone. A future's result is the bytes moved; a failure is
    a one-line ``OffloadIOError`` naming path and byte range (a read past EOF fails).

    Args:
        workers: Threads in the pool.
        chunk_bytes: Bytes per system call (a multiple of ``ALIGN``).
        fsync: ``write`` futures complete only after ``os.fsync`` of the file.
        direct: Use O_DIRECT where the filesystem allows it.
    """

    def __init__(self, workers: int = 4, *, chunk_bytes: int = CHUNK, fsync: bool = False,
                 direct: bool = True):
        if workers < 1 or chunk_bytes < ALIGN or chunk_bytes % ALIGN:
            raise ValueError(f"AsyncIO: need workers >= 1 and chunk_bytes a positive multiple "
                             f"of {ALIGN}, got {workers} and {chunk_bytes}")
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="moezero-aio")
        self._chunk, self._fsync = chunk_bytes, fsync
        self._direct = direct and hasattr(os, "O_DIRECT")
        self._lock = threading.RLock()
        self._files: dict[str, _File] = {}
        self._direct_dirs: dict[str, bool] = {}
        gds = torch.cuda.is_available() and hasattr(getattr(torch.cuda, "gds", None), "GdsFile")
        self._gds: dict[str, object] | None = {} if gds else None
        self._probe = aligned_empty(ALIGN, torch.uint8).numpy()
        self._closed = False
        self.stats = {"direct_bytes": 0, "buffered_bytes": 0, "gds_bytes": 0}

    def read(self, path: str | os.PathLike, tensor: torch.Tensor, offset: int = 0) -> Future:
        """Fill ``tensor`` from the file's bytes ``[offset, offset + tensor.nbytes)``."""
        return self._dispatch("read", path, tensor, offset)

    def write(self, path: str | os.PathLike, tensor: torch.Tensor, offset: int = 0) -> Future:
        """Write ``tensor``'s bytes at ``offset`` (the file is created or extended as needed)."""
        return self._dispatch("write", path, tensor, offset)

    def uses_direct(self, path: str | os.PathLike) -> bool:
        """Whether transfers in ``path``'s directory go through O_DIRECT (after its probe)."""
        return self._direct_dirs.get(os.path.dirname(os.path.abspath(path)), False)

    def release(self, path: str | os.PathLike) -> None:
        """Close the cached descriptors of ``path`` (none of its transfers may be pending)."""
        with self._lock:
            f = self._files.pop(os.path.abspath(path), None)
            if self._gds is not None:
                self._gds.pop(os.path.abspath(path), None)
        _close(f)

    def close(self) -> None:
        """Wait for pending transfers, stop the workers and close every descriptor."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        for f in self._files.values():
            _close(f)
        self._files.clear()
        self._gds = None

    def __enter__(self) -> AsyncIO:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _dispatch(self, op: str, path, tensor: torch.Tensor, offset: int) -> Future:
        if self._closed:
            raise RuntimeError("AsyncIO is closed")
        if not isinstance(offset, int) or offset < 0:
            raise ValueError(f"{path}: offset must be a non-negative int, got {offset!r}")
        path = os.path.abspath(path)
        if tensor.device.type == "cuda":
            return self._cuda(op, path, tensor, offset)
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            got = "a non-contiguous one" if tensor.device.type == "cpu" else tensor.device
            raise ValueError(f"{path}: {op} needs a contiguous CPU tensor, got {got}")
        return self._submit(op, path, tensor, offset, [])

    def _submit(self, op: str, path: str, tensor: torch.Tensor, offset: int,
                finish: list[Callable[[], object]]) -> Future:
        view = _byte_view(tensor)
        span = f"{path}: {op} of bytes [{offset}, {offset + len(view)}) failed"
        try:
            f = self._open(path, create=op == "write")
        except OSError as err:
            req = _Request(span, 1, 0, [])
            req.piece_done(err)
            return req.future
        if op == "write" and self._fsync:
            finish = [lambda: os.fsync(f.fd), *finish]
        pieces = _pieces(tensor.data_ptr(), len(view), offset, self._chunk, f.direct)
        req = _Request(span, len(pieces), len(view), finish)
        for start, stop, direct in pieces:
            self._pool.submit(_run, req, self._piece, op, f, view[start:stop], offset + start,
                              direct)
        return req.future

    def _piece(self, op: str, f: _File, view: memoryview, offset: int, direct: bool) -> None:
        direct = direct and f.direct
        if direct:
            try:
                _transfer(op, (f.dfd, f.fd), view, offset)
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise
                f.direct = direct = False  # the probe passed, yet this I/O was refused
                self._refuse(f.folder, err)
        if not direct:
            _transfer(op, (f.fd,), view, offset)
        self._count("direct_bytes" if direct else "buffered_bytes", len(view))

    def _open(self, path: str, *, create: bool) -> _File:
        with self._lock:
            f = self._files.get(path)
            if f is None:
                flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0)
                fd = os.open(path, flags, 0o600)
                dfd = self._open_direct(path)
                f = self._files[path] = _File(fd, dfd, os.path.dirname(path), dfd is not None)
            return f

    def _open_direct(self, path: str) -> int | None:
        """An O_DIRECT descriptor of ``path`` if its directory allows it (probed once)."""
        folder = os.path.dirname(path)
        if not self._direct or self._direct_dirs.get(folder) is False:
            return None
        try:
            dfd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_DIRECT)
        except OSError as err:
            self._refuse(folder, err)
            return None
        if folder not in self._direct_dirs:
            try:
                os.preadv(dfd, [self._probe], 0)  # some filesystems accept the open, not the I/O
            except OSError as err:
                os.close(dfd)
                self._refuse(folder, err)
                return None
            self._direct_dirs[folder] = True
        return dfd

    def _refuse(self, folder: str, err: OSError) -> None:
        """Stop opening O_DIRECT descriptors in ``folder``; log the reason once."""
        with self._lock:
            if self._direct_dirs.get(folder) is False:
                return
            self._direct_dirs[folder] = False
            log.warning("O_DIRECT refused in %s (%s: %s); I/O there is buffered", folder,
                        errno.errorcode.get(err.errno, err.errno), err.strerror or err)

    def _count(self, key: str, nbytes: int) -> None:
        with self._lock:
            self.stats[key] += nbytes

    def _cuda(self, op: str, path: str, tensor: torch.Tensor, offset: int) -> Future:
        """GPUDirect Storage when usable, else through a pinned host buffer (untested on CPU)."""
        whole = tensor.nbytes == tensor.untyped_storage().nbytes()  # cuFile moves whole storages
        gds = self._gds_file(path) if whole and tensor.is_contiguous() else None
        if gds is not None:
            span = f"{path}: {op} (GDS) of bytes [{offset}, {offset + tensor.nbytes}) failed"
            finish = [lambda: self._count("gds_bytes", tensor.nbytes)]
            if op == "write" and self._fsync:
                finish.append(lambda: os.fsync(gds.fd))
            req = _Request(span, 1, tensor.nbytes, finish)
            move = gds.load_storage if op == "read" else gds.save_storage
            self._pool.submit(_run, req, move, tensor.untyped_storage(), offset)
            return req.future
        host = aligned_empty(tensor.numel(), tensor.dtype, pin=True)
        if op == "write":
            host.copy_(tensor.reshape(-1))
            return self._submit(op, path, host, offset, [])
        return self._submit(op, path, host, offset, [lambda: tensor.copy_(host.view(tensor.shape))])

    def _gds_file(self, path: str):
        with self._lock:
            if self._gds is None:
                return None
            if path not in self._gds:
                try:
                    self._gds[path] = torch.cuda.gds.GdsFile(path, os.O_RDWR | os.O_CREAT)
                except (OSError, RuntimeError) as err:
                    log.warning("GPUDirect Storage unusable (%s); staging through host memory",
                                str(err).splitlines()[0] if str(err) else type(err).__name__)
                    self._gds = None
                    return None
            return self._gds[path]


def _run(req: _Request, fn: Callable, *args) -> None:
    """One piece of a request on a worker: its error, if any, goes to the request's future."""
    try:
        fn(*args)
    except Exception as err:
        req.piece_done(err)
    else:
        req.piece_done(None)


def _byte_view(tensor: torch.Tensor) -> memoryview:
    if not tensor.numel():
        return memoryview(bytearray())
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def _pieces(addr: int, nbytes: int, offset: int, chunk: int,
            direct: bool) -> list[tuple[int, int, bool]]:
    """``(start, stop, direct)`` byte ranges of at most ``chunk`` bytes: with ``direct``, the
    aligned middle is direct; an unaligned head/tail (or all, if buffer and offset disagree
    modulo ``ALIGN``) is buffered."""
    if not direct or (addr - offset) % ALIGN:
        return [(s, min(s + chunk, nbytes), False) for s in range(0, nbytes, chunk)]
    head = min(nbytes, -offset % ALIGN)
    body = head + (nbytes - head) // ALIGN * ALIGN
    pieces = [(0, head, False)] if head else []
    pieces += [(s, min(s + chunk, body), True) for s in range(head, body, chunk)]
    return pieces + ([(body, nbytes, False)] if body < nbytes else [])


def _transfer(op: str, fds: tuple[int, ...], view: memoryview, offset: int) -> None:
    """Move all of ``view``; after a short transfer (EOF inside a block) use the last fd."""
    call = os.preadv if op == "read" else os.pwritev
    fd = fds[0]
    while view:
        done = call(fd, [view], offset)
        if not done:
            raise EOFError(f"the file ends at byte {os.fstat(fd).st_size}")
        view, offset, fd = view[done:], offset + done, fds[-1]


def _close(f: _File | None) -> None:
    for fd in (f.fd, f.dfd) if f else ():
        if fd is not None:
            os.close(fd)


# ---------------------------------------------------------------- swap files

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
