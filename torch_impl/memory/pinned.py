"""Page-locked host buffers, reused by size: the pinned memory of the offloaded tiers on CUDA.

PyTorch's pinned allocator (``pin_memory=True``) rounds every request up to a power of two and
caches freed blocks for the rest of the process, so buffers allocated per window per step
(swap windows, gradient copies, staging for GPUDirect fallback) could pin about twice what
they use and never give it back. A ``PinnedPool`` maps each buffer at its exact
``aligned_size`` (its own pages, 4096-aligned for O_DIRECT), page-locks it with
``cudaHostRegister`` and hands it out again to the next request of the same size: pinned
bytes are bounded by the most bytes of each size in use at once (``pinned_bytes``), all of it
counted by the offload meter while in use, and unregistered on ``close``. Without CUDA nothing
is pinned (``aligned_empty``). The host memory behind them, and behind the unpinned swap
buffers, is ``host_map``'s (private, huge pages asked for); ``advise_huge_pages`` asks the
same of memory already allocated (the stage-3 gathered storages, ``zero.group_storage``).
Used by ``moezero.offload.state``, ``moezero.offload.aio`` and ``moezero.zero.transfer`` (and
``sharded`` for its pinned param copies).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
import threading
import weakref
from collections.abc import Callable

import torch

ALIGN = 4096  # O_DIRECT granularity of buffer address, file offset and length (512e and 4Kn)
MADV_HUGEPAGE = 14  # Linux <asm-generic/mman-common.h>
HUGE_PAGE = 2 << 20


def aligned_size(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of ``ALIGN``."""
    return -(-nbytes // ALIGN) * ALIGN


def host_map(nbytes: int) -> mmap.mmap:
    """``nbytes`` of private anonymous memory in a mapping of its own, asking for transparent
    huge pages (``MADV_HUGEPAGE``, where the kernel has it). Python's ``mmap(-1, n)`` is a
    *shared* mapping: shmem, every page faulted through the page cache one 4 KiB page at a
    time (shmem huge pages are off by default), counted as shared memory, not anonymous; on
    the ``nvme`` benchmark those faults were a fifth of the ranks' CPU time."""
    mapped = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapped.madvise(mmap.MADV_HUGEPAGE)
    return mapped


def advise_huge_pages(ptr: int, nbytes: int) -> bool:
    """Ask Linux for transparent huge pages over the 2 MiB-aligned part of ``nbytes`` at
    ``ptr`` (``madvise(MADV_HUGEPAGE)``), memory not yet touched: its faults then map 2 MiB
    at a time instead of 4 KiB (the kernel's default policy, ``madvise``, gives huge pages
    only where asked). False where nothing was advised (too small, not Linux, refused)."""
    lo, hi = -(-ptr // HUGE_PAGE) * HUGE_PAGE, (ptr + nbytes) // HUGE_PAGE * HUGE_PAGE
    if hi <= lo or not sys.platform.startswith("linux"):
        return False
    madvise = _madvise()
    return madvise is not None and madvise(lo, hi - lo, MADV_HUGEPAGE) == 0


@functools.cache
def _madvise():
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise


def cuda_register(ptr: int, nbytes: int) -> None:
    """Page-lock ``nbytes`` at ``ptr`` for CUDA copies (``cudaHostRegister``)."""
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    if int(getattr(err, "value", err)):
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed ({err})")


def cuda_unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


class PinnedPool:
    """Exact-size pinned host buffers, reused by size once every view of one has died;
    thread-safe. Nothing is handed back explicitly: each ``take`` wraps its mapping in a fresh
    ``memoryview`` whose finalizer returns the mapping to the free list.

    Args:
        register: Page-locks ``(ptr, nbytes)`` (default ``cudaHostRegister``).
        unregister: Undoes it for ``ptr`` (default ``cudaHostUnregister``).
    """

    def __init__(self, register: Callable[[int, int], None] | None = None,
                 unregister: Callable[[int], None] | None = None):
        self._register = register or cuda_register
        self._unregister = unregister or cuda_unregister
        self._owned: list[tuple[int, mmap.mmap]] = []  # (ptr, mapping), registered
        self._free: dict[int, list[mmap.mmap]] = {}  # size -> mappings no tensor uses
        self._lock = threading.Lock()

    @property
    def pinned_bytes(self) -> int:
        """Bytes page-locked now (in use or free for reuse)."""
        with self._lock:
            return sum(len(mapped) for _, mapped in self._owned)

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A pinned, 4096-aligned 1-D buffer of ``numel`` elements (uninitialised), back in
        the pool when the last tensor viewing it dies."""
        size = aligned_size(max(numel * dtype.itemsize, 1))
        with self._lock:
            free = self._free.get(size)
            mapped = free.pop() if free else None
        if mapped is None:
            mapped = host_map(size)
            ptr = torch.frombuffer(mapped, dtype=torch.uint8).data_ptr()
            self._register(ptr, size)
            with self._lock:
                self._owned.append((ptr, mapped))
        view = memoryview(mapped)
        weakref.finalize(view, self._back, mapped)
        return torch.frombuffer(view, dtype=torch.uint8).view(dtype)[:numel]

    def _back(self, mapped: mmap.mmap) -> None:
        with self._lock:
            if any(m is mapped for _, m in self._owned):  # not after close
                self._free.setdefault(len(mapped), []).append(mapped)

    def close(self) -> None:
        """Unregister every buffer; those still in use stay valid host memory, unpinned."""
        with self._lock:
            owned, self._owned, self._free = self._owned, [], {}
        for ptr, _ in owned:
            self._unregister(ptr)
