"""Preemption: a signal asks every rank to finish its current step, save and exit.

Schedulers send SIGTERM before they preempt a job (Slurm, Kubernetes; Slurm's ``--signal``
often SIGUSR1). ``StopRequest`` is one rank's view of such a request: the first of
``PreemptOptions.signals`` received by this process (or an event set by the launcher that
spawned it, which received the signal itself) marks it; ``agree`` all-reduces the mark each
step, so every rank stops after the same step even when only one was signalled. The first
signal also restores the default action of every preemption signal, so a second one ends the
process at once (no save). A spawned rank whose launcher dies gets ``PARENT_DEATH_SIGNAL``
from the kernel (once per thread of the dead launcher): it asks for the same save, however
often it comes, and never aborts it. The training loop then saves, waits for the save and raises
``Preempted``; the launcher turns it into ``PREEMPTED_EXIT``. Only the launcher installs
handlers (``install``), in each rank's main thread; library code receives the object.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["PARENT_DEATH_SIGNAL", "PREEMPTED_EXIT", "PreemptOptions", "Preempted", "StopRequest",
           "abort_code"]

PREEMPTED_EXIT = 75
"""Exit code of a run stopped by a preemption signal after its checkpoint was committed
(``EX_TEMPFAIL``: resume with ``--set checkpoint.load=latest``). docs/reliability.md."""


PARENT_DEATH_SIGNAL = int(signal.SIGRTMIN)
"""What a spawned rank receives when its launcher dies (``PR_SET_PDEATHSIG``): a real-time
signal no scheduler sends, since the kernel sends it again for every thread of the dying
launcher (a preemption signal's second delivery would abort the save it started)."""


def abort_code(signum: int) -> int:
    """Exit code of a run aborted by a second signal: the shell's 128 + signal number."""
    return 128 + signum


@dataclass(frozen=True)
class PreemptOptions:
    """Attributes:
        signals: The signals that ask for a save and a stop (``train.preempt_signals``);
            empty: preemption is off and signals keep their default action.
    """

    signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)

    @classmethod
    def from_names(cls, names: Sequence[str]) -> PreemptOptions:
        """From names such as ``"SIGTERM"`` (checked by the config's schema)."""
        return cls(tuple(int(signal.Signals[name]) for name in names))


class Preempted(Exception):  # an outcome, not a failure
    """The run stopped after ``step`` because of a preemption signal; its checkpoint is
    ``checkpoint`` (committed)."""

    def __init__(self, step: int, checkpoint):
        super().__init__(f"preempted after step {step}; checkpoint {checkpoint}")
        self.step, self.checkpoint = step, checkpoint


class StopRequest:
    """One rank's stop request: set by a preemption signal to this process or by ``event``
    (the launcher's flag, ``rendezvous.Flag``, set when it is signalled)."""

    def __init__(self, options: PreemptOptions | None = None, event=None):
        self.options = options or PreemptOptions()
        self.event = event
        self.signal: int | None = None
        self.orphaned = False
        self._previous: dict[int, object] = {}

    def install(self, *, parent_death: bool = False) -> StopRequest:
        """Handle the preemption signals in this process (main thread only); with
        ``parent_death``, ``PARENT_DEATH_SIGNAL`` too."""
        for sig in self.options.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        if parent_death:
            self._previous[PARENT_DEATH_SIGNAL] = signal.signal(PARENT_DEATH_SIGNAL,
                                                                self._on_parent_death)
        return self

    def uninstall(self) -> None:
        """Put back the handlers ``install`` replaced."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _on_signal(self, signum: int, frame) -> None:
        self.signal = signum
        for sig in self.options.signals:  # the next one ends the process: no second save
            signal.signal(sig, signal.SIG_DFL)

    def _on_parent_death(self, signum: int, frame) -> None:
        self.orphaned = True  # repeated deliveries change nothing

    @property
    def requested(self) -> bool:
        """This rank was asked to stop (by a signal, its launcher's death, or through the
        launcher's event)."""
        return (self.signal is not None or self.orphaned
                or (self.event is not None and self.event.is_set()))

    @property
    def reason(self) -> str:
        """Why this rank stops, for the line that reports it."""
        if self.orphaned:
            return "the launcher died"
        if self.signal is not None:
            return signal.Signals(self.signal).name
        if self.event is not None and self.event.is_set():
            return "a signal to the launcher"
        return "a signal to another rank"

    def agree(self, device: torch.device | str = "cpu") -> bool:
        """Whether any rank was asked to stop (collective on the world group: every rank
        calls it once per step; one element all-reduced on ``device``)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.requested
        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
