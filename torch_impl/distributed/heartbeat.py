"""Heartbeats of spawned ranks, so the launcher names a rank that stops answering.

A rank that is stopped (SIGSTOP), swapped out for good or stuck with its interpreter frozen
leaves its peers waiting in a collective for the whole ``dist.timeout_s`` (which must stay long
for legitimately long collectives), and then the peers' timeout is what gets reported. Each
spawned rank therefore runs ``Beat``: a daemon thread that touches ``heartbeat-<rank>`` in the
rendezvous folder every ``heartbeat_s / BEATS_PER_PERIOD`` seconds; the launcher's ``Pulse``
reads those times while it waits for the ranks and names the first rank silent for more than
``heartbeat_s`` (``dist.heartbeat_s``). A rank not yet beating (still importing) is given
``startup_s``. Under torchrun there is no launcher of ours: torchrun watches its workers.

A pause of the whole job (Ctrl-Z, ``docker pause``, a laptop that sleeps) stops the launcher
too, and every rank's last beat is then as old as the pause: it is not a hang. The launcher
looks at least every ``_watch`` poll (half a second); when two looks are more than
``STALL_S`` apart by the wall clock (the clock of the beat files, which also runs through a
suspend), the watcher itself was stopped, so it cannot tell who was: every rank's count
restarts at the resume (the ranks then have ``heartbeat_s`` to beat again).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Beat", "Pulse", "WatchOptions"]

BEATS_PER_PERIOD = 6
STALL_S = 2.0
"""A gap between two looks of the launcher longer than this means it was stopped itself."""


@dataclass(frozen=True)
class WatchOptions:
    """How the launcher watches its ranks.

    Attributes:
        heartbeat_s: A rank silent this long is reported as hung and the job is stopped.
        log_dir: The run's ``logs/`` folder: a dead or hung rank's line points to its log
            there (``rank<r>.log``, where the launcher notes what happened); None: no note.
    """

    heartbeat_s: float = 30.0
    log_dir: Path | None = None


def beat_path(folder: str | Path, rank: int) -> Path:
    return Path(folder, f"heartbeat-{rank}")


class Beat:
    """A rank's heartbeat: a daemon thread touching its file until the process ends."""

    def __init__(self, folder: str | Path, rank: int, heartbeat_s: float):
        self.path = beat_path(folder, rank)
        self.every_s = max(0.05, heartbeat_s / BEATS_PER_PERIOD)
        self._thread = threading.Thread(target=self._run, name="moezero-heartbeat", daemon=True)

    def start(self) -> Beat:
        self.path.touch()
        self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            try:
                self.path.touch()
            except OSError:  # the folder went away: the launcher is gone
                return
            time.sleep(self.every_s)


class Pulse:
    """The launcher's view of its ranks' heartbeats.

    ``clock`` gives wall-clock seconds (``time.time``, the clock of file times); tests pass
    their own.
    """

    def __init__(self, folder: str | Path, heartbeat_s: float, startup_s: float,
                 clock: Callable[[], float] = time.time):
        self.folder, self.heartbeat_s, self.startup_s = Path(folder), heartbeat_s, startup_s
        self.clock = clock
        self.started = self.resumed = self.looked = clock()

    def silent(self, ranks: Iterable[int]) -> tuple[int, float] | None:
        """The first of ``ranks`` (those still running) silent for too long, and for how many
        seconds; None when every one is beating."""
        now = self._look()
        for rank in sorted(ranks):
            try:
                age = now - max(beat_path(self.folder, rank).stat().st_mtime, self.resumed)
                limit = self.heartbeat_s
            except FileNotFoundError:
                age, limit = now - self.started, self.startup_s
            if age > limit:
                return rank, age
        return None

    def _look(self) -> float:
        """Now; after a gap since the last look longer than ``STALL_S`` (the launcher was
        stopped with its ranks), every count restarts now."""
        now = self.clock()
        gap = now - self.looked
        if gap > STALL_S:
            self.resumed = now
            self.started += gap
        self.looked = now
        return now
