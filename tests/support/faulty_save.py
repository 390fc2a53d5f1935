"""Checkpoint save faults for tests: a ``moezero.checkpoint.writer.SaveWriter`` that sleeps
before each partition, the manifest and the commit (so crash tests can land a SIGKILL inside a
save), or fails one rank's writes of one step with ENOSPC, as on a full disk. It reaches the
save path as the I/O options' ``save_writer`` (``faulty_io``), the seam a storage writer plugs
into: production holds no fault option. docs/reliability.md.
"""

from __future__ import annotations

import errno
import functools
import os
import time
from pathlib import Path

from moezero.checkpoint.writer import SaveWriter
from moezero.offload.options import IOOptions


class FaultySaveWriter(SaveWriter):
    """``SaveWriter`` with ``delay_s`` before each partition, the manifest and the commit, and
    ENOSPC for every partition written by rank ``enospc[0]`` at step ``enospc[1]``."""

    def __init__(self, *args, delay_s: float = 0.0, enospc: tuple[int, int] | None = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.delay_s, self.enospc = delay_s, enospc

    def _pause(self) -> None:
        if self.delay_s > 0:
            time.sleep(self.delay_s)

    def shard(self, partial: Path, layout, *args, **kwargs):
        if self.enospc is not None and tuple(self.enospc) == (self.rank, self.step):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC),
                          str(partial / layout.files[0].name))
        self._pause()
        return super().shard(partial, layout, *args, **kwargs)

    def manifest(self, *args, **kwargs) -> None:
        self._pause()
        super().manifest(*args, **kwargs)

    def commit(self, *args, **kwargs) -> Path:
        self._pause()
        return super().commit(*args, **kwargs)


def faulty_io(*, delay_s: float = 0.0, enospc: tuple[int, int] | None = None,
              **options) -> IOOptions:
    """``IOOptions(**options)`` whose checkpoint saves write through a ``FaultySaveWriter``
    (picklable: it travels to spawned ranks)."""
    writer = functools.partial(FaultySaveWriter, delay_s=delay_s, enospc=enospc)
    return IOOptions(**options, save_writer=writer)
