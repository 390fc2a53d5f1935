"""Where a training step's time and swap bytes go, phase by phase.

``StepPhases`` times the phases of ``Engine.train_step`` (``forward``, ``backward`` with the
gradient reduction it launches, ``reduce``: the reduction's end, ``step``: clip and AdamW)
and takes the optimizer's swap counters (``Optimizer.swap_traffic``: bytes read and written
and seconds spent waiting on the I/O engine, per tier ``optim`` / ``param`` / ``grad``) at
the end of each, so a step's bytes and waits are split by the phase that issued them (a read
ahead counts where it was issued: the step reads the next forward's first units, the forward
backward's first ones): e.g. at stage 3 with
NVMe params and optimizer, the param shard reads of forward and of backward, the gradient
writes of backward, the gradient reads and the master/moment reads and writes of the step.
A wait is the time a thread spent blocked on a transfer: on the main thread (param loads,
the step's reads) it is time the disk kept compute waiting; the gradient writes of backward
are waited for on the reduction's helper thread, and with ``offload_optimizer.step_in_forward``
the step's reads and writes on its own thread during the next forward (whose main thread
waits, as param waits, only for the groups it gathers). Compute is a phase's time less its
main-thread waits. The row keys are ``phases`` (nested) and the step totals ``swap_*``.
Reference counterpart: none (telemetry).
"""

from __future__ import annotations

import time
from collections.abc import Callable

PHASES = ("forward", "backward", "reduce", "step")
TIERS = ("optim", "param", "grad")


class StepPhases:
    """Seconds and swap counter deltas of each phase of one step.

    Args:
        traffic: The optimizer's counters so far (``Optimizer.swap_traffic``).
    """

    def __init__(self, traffic: Callable[[], dict]):
        self.traffic = traffic
        self.start = self.last = traffic()
        self.time = time.perf_counter()
        self.phases = {name: {"s": 0.0} for name in PHASES}

    def mark(self, name: str) -> None:
        """Phase ``name`` just ended: add the time and swap counter deltas since the previous
        mark (or the start) to it. Marks are contiguous, so a transfer a helper thread issues
        between two phases is counted (in the later one)."""
        now, counters = time.perf_counter(), self.traffic()
        row = self.phases[name]
        row["s"] += now - self.time
        for key, value in counters.items():
            row[key] = row.get(key, 0) + value - self.last[key]
        self.time, self.last = now, counters

    def metrics(self) -> dict:
        """``phases`` (per phase: ``s``, and with swap files the tiers' ``<tier>_read`` /
        ``_write`` bytes and ``_wait_s`` seconds) and the step's ``swap_*`` totals."""
        swapped = any(v for row in self.phases.values() for k, v in row.items() if k != "s")
        phases = self.phases if swapped else {n: {"s": r["s"]} for n, r in self.phases.items()}
        return {"phases": phases, **swap_metrics(self.start, self.traffic())}


def swap_metrics(before: dict, after: dict) -> dict[str, int]:
    """This step's bytes read from / written to the rank's swap files (``swap_read_bytes``,
    ``swap_write_bytes``: optimizer state, param shards and gradients), and of them the
    stage-3 param shards' (``swap_param_*``)."""
    delta = {key: after[key] - before[key] for key in after}
    total = lambda op: sum(delta[f"{tier}_{op}"] for tier in TIERS)
    return {"swap_read_bytes": total("read"), "swap_write_bytes": total("write"),
            "swap_param_read_bytes": delta["param_read"],
            "swap_param_write_bytes": delta["param_write"]}
