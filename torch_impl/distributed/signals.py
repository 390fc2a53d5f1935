"""Preemption: a signal asks every rank to finish its current step, save and exit.

Schedulers send SIGTERM before they preempt a job (Slurm, Kubernetes; Slurm's ``--signal``
often SIGUSR1). ``StopRequest`` is one rank's view of such a request: the first of
``PreemptOptions.signals`` received by this process (or an event set by the launcher that
spawned it, which received the signal itself) marks it; ``agree`` all-reduces the mark each
step, so every rank stops after the same step even when only one was signalled. The first
signal also restores the default action of every preemption signal, so a second one ends the
process at once (no save). The training loop then saves, waits for the save and raises
``Preempted``; the launcher turns it into ``PREEMPTED_EXIT``. Only the launcher installs
handlers (``install``), in each rank's main thread; library code receives the object.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["PREEMPTED_EXIT", "PreemptOptions", "Preempted", "StopRequest", "abort_code"]

PREEMPTED_EXIT = 75
"""Exit code of a run stopped by a preemption signal after its checkpoint was committed
(``EX_TEMPFAIL``: resume with ``--set checkpoint.load=latest``). docs/reliability.md."""


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


class Preempted(Exception):  # noqa: N818 (an outcome, not a failure)
    """The run stopped after ``step`` because of a preemption signal; its checkpoint is
    ``checkpoint`` (committed)."""

    def __init__(self, step: int, checkpoint):
        super().__init__(f"preempted after step {step}; checkpoint {checkpoint}")
        self.step, self.checkpoint = step, checkpoint


class StopRequest:
    """One rank's stop request: set by a preemption signal to this process or by ``event``
    (a ``multiprocessing`` event the launcher sets when it is signalled)."""

    def __init__(self, options: PreemptOptions | None = None, event=None):
        self.options = options or PreemptOptions()
        self.event = event
        self.signal: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> StopRequest:
        """Handle the preemption signals in this process (main thread only)."""
        for sig in self.options.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
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

    @property
    def requested(self) -> bool:
        """This rank was asked to stop (by a signal, or through the launcher's event)."""
        return self.signal is not None or (self.event is not None and self.event.is_set())

    def agree(self, device: torch.device | str = "cpu") -> bool:
        """Whether any rank was asked to stop (collective on the world group: every rank
        calls it once per step; one element all-reduced on ``device``)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.requested
        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
