"""How moezero's file bytes reach the disk: one frozen options object, passed to every writer.

The defaults are what a run uses; ``initialize(..., io=IOOptions(...))`` sets them for an
engine (its checkpoints and NVMe swap files), and tests pass their own instead of changing
module state. Fault injection is not an option: a test passes its own checkpoint writer
(``save_writer``, the seam a storage writer plugs into).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moezero.plan.bytes_io import CHUNK


@dataclass(frozen=True)
class IOOptions:
    """I/O behaviour of checkpoint saves and swap files.

    Attributes:
        direct_io: Move aligned bulk with O_DIRECT where the filesystem allows it (checkpoint
            ranges and swap files); False: everything through the page cache.
        direct_min_bytes: Checkpoint ranges shorter than this are written through the page
            cache: below it the per-request cost of the thread pool outweighs what O_DIRECT
            saves (measured crossover here: 256 KiB-1 MiB).
        stage_bytes: Bytes per staging buffer of the checkpoint's O_DIRECT writer (two per
            rank during a save; 8, 16, 32 and 64 MiB measured here: 16 was fastest).
        chunk_bytes: Bytes per pread/pwrite call of the async I/O engine (a multiple of 4096).
        syncfs: Flush a rank's checkpoint files with one ``syncfs`` where that is known to be
            enough (``checkpoint.writer.FolderFlush``); False: ``fsync`` file by file.
        host_mmap_threshold: With an offloaded tier (``cpu`` or ``nvme``), host blocks of this
            many bytes or more are mapped and returned to the OS when freed
            (``moezero.offload.malloc``: glibc's dynamic threshold otherwise keeps a step's
            freed buffers resident); None: glibc's default.
        save_writer: Makes a rank's writer of one checkpoint save:
            ``save_writer(io, refused, rank=, step=)`` -> a ``moezero.checkpoint.writer.SaveWriter``
            (that class when None; tests pass a subclass that delays or fails the writes).
    """

    direct_io: bool = True
    direct_min_bytes: int = 512 << 10
    stage_bytes: int = 16 << 20
    chunk_bytes: int = CHUNK
    syncfs: bool = True
    host_mmap_threshold: int | None = 1 << 20
    save_writer: Callable[..., Any] | None = None
