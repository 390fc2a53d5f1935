"""The offloaded step behind the next forward (``offload_optimizer.step_in_forward``).

At stage 3 with the optimizer and the params on NVMe the step's writes cannot start before
backward ends (exact global-norm clipping needs every gradient), but the next forward need
not wait for all of them. ``StepBehind`` runs the step's windows (``Optimizer._step_host``)
on a background thread once the clip coefficient is known, and returns. Every trained
group's param files are *gated* (``offload.state.SwapState.gate``) until its window's masters
are written: the forward's gather of a group waits for that in ``SwapState.load``, and no read
ahead starts for a gated group (it would return the old bytes). In fp32, where a param shard
is its master's bytes, each updated master is also handed to that gather (``SwapState.offer``,
bounded by ``handover_bytes`` waiting unread), which then reads nothing. The same numbers as
the step run first; whatever else reads the state, the gradients or the params first waits
for the whole step (``finish``, which raises there what the step failed with; the gates open
on failure too, so no forward hangs). docs/offload.md; Reference counterpart: none.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence


class StepBehind:
    """One step at a time on a background thread, gating ``swap``'s files (the param swap
    files, duck-typed: ``gate``, ``open``, ``offer``, ``offered_bytes``, ``alias``)."""

    def __init__(self, swap, handover_bytes: int) -> None:
        self.swap, self.handover_bytes = swap, handover_bytes
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, slots: Sequence, run: Callable[..., None]) -> None:
        """Gate ``slots`` and run ``run(written=..., issued=...)`` (``SwapState.stepping``'s
        hooks: a window's files written, a slot's writes started) on the thread."""
        self.finish()
        self.swap.gate(slots)
        hooks = {"written": self.swap.open}
        if self.swap.alias == "master":  # fp32: the params are the masters' bytes
            hooks["issued"] = self._hand_over

        def body() -> None:
            try:
                run(**hooks)
            except BaseException as e:  # any error: raised again by finish
                self._error = e
            finally:
                self.swap.open(slots)

        self._thread = threading.Thread(target=body, name="moezero-step", daemon=True)
        self._thread.start()

    def finish(self) -> None:
        """Wait for the step running behind, if any, and raise what it failed with (once)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _hand_over(self, slot, bufs: dict) -> None:
        """``slot``'s updated master (being written) to the next forward's gather of its param
        shard, while at most ``handover_bytes`` wait there unread (else it reads them)."""
        if self.swap.offered_bytes() + bufs["master"].nbytes <= self.handover_bytes:
            self.swap.offer(slot, {"param": bufs["master"]})
