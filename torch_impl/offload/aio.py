"""NVMe offload I/O: aligned host buffers and an async file-I/O engine.

``AsyncIO`` splits each request into 8 MiB chunks that a thread pool moves with ``preadv`` /
``pwritev``; aligned chunks (address, offset, length multiples of ``ALIGN``) use O_DIRECT, so
swap traffic neither fills nor is flattered by the page cache. O_DIRECT is probed once per
directory; where it is refused (FUSE, tmpfs before Linux 6.6, ...) I/O there is buffered and
the reason logged once on ``moezero.offload``. CUDA tensors use GPUDirect Storage
(``torch.cuda.gds``) when cuFile works, else a pinned host buffer: neither runs without a GPU,
so both are small and guarded. The swap files themselves are ``moezero.offload.swapdir``'s.
Reference counterpart: none (the reference keeps every state in memory).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from moezero.memory.pinned import ALIGN, PinnedPool, aligned_size, host_map
from moezero.plan.bytes_io import CHUNK, byte_view

__all__ = ["ALIGN", "AsyncIO", "OffloadIOError", "aligned_empty", "aligned_size", "wait"]

MAPPED_BYTES = 1 << 20  # aligned_empty maps buffers of at least this size with mmap
log = logging.getLogger("moezero.offload")


class OffloadIOError(OSError):
    """A failed swap transfer, one line: ``<path>: <op> of bytes [a, b) failed: <why>``."""


def aligned_empty(numel: int, dtype: torch.dtype, *, pin: bool = False) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor starting on a 4096-byte boundary (an O_DIRECT buffer).

    Its storage runs ``aligned_size(nbytes)`` past the start. ``pin`` page-locks it only when
    CUDA is available (CPU builds of torch refuse ``pin_memory``); otherwise it is ignored.
    Unpinned buffers of ``MAPPED_BYTES`` or more are anonymous mappings of their own (page
    aligned), unmapped when the last view dies: the swap buffers of a large model come and go
    by the gigabyte, and from malloc's heap (glibc raises its mmap threshold up to 32 MiB after
    such frees) they left ~1.5 GB per rank resident and fragmented after a step of the
    ``scale`` benchmark (docs/scale.md).
    """
    nbytes = aligned_size(numel * dtype.itemsize)
    pin = pin and torch.cuda.is_available()
    if not pin and nbytes >= MAPPED_BYTES:  # its own pages, back to the OS when freed
        return torch.frombuffer(host_map(nbytes), dtype=torch.uint8).view(dtype)[:numel]
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
        readonly: Open files read-only and refuse writes (files this job did not create, such
            as a base checkpoint read in place: ``moezero.offload.base_params``).
    """

    def __init__(self, workers: int = 4, *, chunk_bytes: int = CHUNK, fsync: bool = False,
                 direct: bool = True, readonly: bool = False):
        if workers < 1 or chunk_bytes < ALIGN or chunk_bytes % ALIGN:
            raise ValueError(f"AsyncIO: need workers >= 1 and chunk_bytes a positive multiple "
                             f"of {ALIGN}, got {workers} and {chunk_bytes}")
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="moezero-aio")
        self._chunk, self._fsync = chunk_bytes, fsync
        self._access = os.O_RDONLY if readonly else os.O_RDWR
        self._direct = direct and hasattr(os, "O_DIRECT")
        self._lock = threading.RLock()
        self._files: dict[str, _File] = {}
        self._direct_dirs: dict[str, bool] = {}
        gds = torch.cuda.is_available() and hasattr(getattr(torch.cuda, "gds", None), "GdsFile")
        self._gds: dict[str, object] | None = {} if gds else None
        self._pinned = PinnedPool() if torch.cuda.is_available() else None  # CUDA staging
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
        if self._pinned is not None:
            self._pinned.close()

    def __enter__(self) -> AsyncIO:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _dispatch(self, op: str, path, tensor: torch.Tensor, offset: int) -> Future:
        if self._closed:
            raise RuntimeError("AsyncIO is closed")
        if op == "write" and self._access == os.O_RDONLY:
            raise ValueError(f"{path}: this I/O engine is read-only")
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
                flags = self._access | os.O_CLOEXEC | (os.O_CREAT if create else 0)
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
            dfd = os.open(path, self._access | os.O_CLOEXEC | os.O_DIRECT)
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
        """GPUDirect Storage when usable, else through a pinned host buffer. The worker first
        waits for the work queued so far on the tensor's stream (a write must not read
        unfinished data, a read must not overwrite data a kernel still reads)."""
        whole = tensor.nbytes == tensor.untyped_storage().nbytes()  # cuFile moves whole storages
        gds = self._gds_file(path) if whole and tensor.is_contiguous() else None
        ready = _queued_work(tensor)
        if gds is not None:
            span = f"{path}: {op} (GDS) of bytes [{offset}, {offset + tensor.nbytes}) failed"
            finish = [lambda: self._count("gds_bytes", tensor.nbytes)]
            if op == "write" and self._fsync:
                finish.append(lambda: os.fsync(gds.fd))
            req = _Request(span, 1, tensor.nbytes, finish)
            move = gds.load_storage if op == "read" else gds.save_storage
            self._pool.submit(_run, req, _after(ready, move), tensor.untyped_storage(), offset)
            return req.future
        host = self._pinned.take(tensor.numel(), tensor.dtype)  # reused once it dies
        if op == "write":
            host.copy_(tensor.reshape(-1))  # blocking: waits for the tensor's stream
            return self._submit(op, path, host, offset, [])
        copy_back = _after(ready, lambda: tensor.copy_(host.view(tensor.shape)))
        return self._submit(op, path, host, offset, [copy_back])

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


def _queued_work(tensor: torch.Tensor):
    """An event after the work queued so far on the current stream of ``tensor``'s device."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event


def _after(event, fn: Callable) -> Callable:
    """``fn`` once ``event`` is done (run on a worker thread: the caller does not wait)."""
    def run(*args):
        event.synchronize()
        return fn(*args)
    return run


def wait(futures: list[Future]) -> None:
    """Wait for every future (the first failure raises once all are done or one fails)."""
    for f in futures:
        f.result()


def _run(req: _Request, fn: Callable, *args) -> None:
    """One piece of a request on a worker: its error, if any, goes to the request's future."""
    try:
        fn(*args)
    except Exception as err:
        req.piece_done(err)
    else:
        req.piece_done(None)


def _byte_view(tensor: torch.Tensor) -> memoryview:
    return byte_view(tensor.detach().reshape(-1).view(torch.uint8).numpy())


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
