"""glibc's treatment of large host blocks in offloaded training.

glibc serves a block above its mmap threshold (128 KiB at start) with its own mapping and
unmaps it when freed; but after each such free it raises the threshold to that block's size,
up to 32 MiB, so the next blocks of that size come from the heap and stay resident when freed
behind a live one. An offloaded step allocates and frees group-sized host buffers (AdamW
temporaries, gradient squares, staging windows) from several threads' arenas, so with the
dynamic threshold a rank keeps gigabytes of freed memory: on the `scale` benchmark's quick
model about 2.9 GiB peak and 2 GiB at rest per rank, against 1.6 GiB and 0.35 GiB with a fixed
1 MiB threshold (docs/scale.md). ``mallopt(M_MMAP_THRESHOLD, n)`` fixes the threshold, as the
environment variable ``MALLOC_MMAP_THRESHOLD_`` does at start-up. Blocks below it still come
from the arenas, where a step's freed ones stay resident between live ones; ``release_free``
(``malloc_trim``) hands those pages back after each step, so the next step's peak does not
stack on the last one's leftovers (the ``bigbase`` series: 16 B LoRA, 3 GiB a rank).
"""

from __future__ import annotations

import ctypes
import functools
import sys

M_MMAP_THRESHOLD = -3  # glibc's <malloc.h>


@functools.cache
def _libc():
    """glibc, or None where this is not glibc on Linux (opened once: ``release_free`` runs
    after every step)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def release_free() -> bool:
    """Return the arenas' free pages to the OS (``malloc_trim(0)``); False where nothing was
    released or this is not glibc."""
    libc = _libc()
    return bool(libc is not None and hasattr(libc, "malloc_trim") and libc.malloc_trim(0))


def map_large_blocks(threshold: int) -> bool:
    """Have glibc map blocks of ``threshold`` bytes or more and unmap them when freed, for
    the rest of this process; False where that is not glibc on Linux (nothing changes)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, int(threshold)))
