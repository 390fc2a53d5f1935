"""Fault injection into checkpoint saves, for tests only: an object the test passes in
(``moezero.cli.main(argv, hooks=...)``, ``launch_training``, ``train``, ``setup``,
``initialize``), never read from the environment or held in the production options. A run
passes none (``SaveHooks()``: no delay, no fault). docs/reliability.md.
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SaveHooks"]


@dataclass(frozen=True)
class SaveHooks:
    """Attributes:
        delay_s: Seconds to sleep before each partition write, the manifest and the commit,
            so crash tests can land a SIGKILL inside a save.
        enospc: ``(rank, step)``: that rank's checkpoint writes of that step fail with
            ENOSPC, as on a full disk.
    """

    delay_s: float = 0.0
    enospc: tuple[int, int] | None = None

    def pause(self) -> None:
        """Sleep ``delay_s`` (nothing by default)."""
        if self.delay_s > 0:
            time.sleep(self.delay_s)

    def fault(self, rank: int, step: int, path: Path) -> None:
        """Raise ENOSPC naming ``path`` when ``(rank, step)`` is ``enospc``."""
        if self.enospc is not None and tuple(self.enospc) == (rank, step):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
