"""Reduced gradient partitions in swap files (stage 3 with ``offload_optimizer.device: nvme``).

Without this tier every local group keeps its reduced gradient partition (``Slot.grad``) in
memory for the whole run: ``shard`` elements in the compute dtype per group, 4 B per owned
element in fp32, i.e. gigabytes per rank for a model of billions of parameters. With it a
group's partition exists only twice per step, briefly:

- **Landing** (``land``, from ``moezero.zero.reduce``): the first reduced bucket that touches
  a group allocates its partition in an aligned host buffer; once every column has landed,
  the sum of squares (fp64) and the count of non-finite elements are taken right there, on
  the whole partition, exactly as the step would have taken them (so the global grad norm, the
  clip coefficient and the fp16 overflow check see every element, bit for bit), and the
  buffer is written to the group's ``grad`` swap file and freed once written. At most
  ``ahead`` elements (beyond the newest partition) are being written at a time: past that the
  landing waits for the oldest write, so the reduction keeps the disk's pace instead of
  holding the step's every partition in memory.
- **Stepping** (``take``, from ``moezero.zero.optimizer``): the step asks for the groups in
  plan order; each request waits for that group's read and starts the reads of the following
  groups, up to ``ahead`` elements in flight, so the disk works while a window steps.

The swap object (``moezero.offload.state.SwapState`` with the one state ``"grad"``) is handed
in by the engine, so this layer never imports ``offload``. Gradients are not checkpointed.
Reference counterpart: none (the reference keeps every gradient in memory).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import torch

from moezero.zero import hostadam
from moezero.zero.shards import Slot, nbytes

__all__ = ["GradTier", "square_sum"]


def square_sum(grad: torch.Tensor):
    """(fp64 sum of fp32 squares, count of non-finite elements) of a gradient in any float
    dtype: the terms of the global grad norm and overflow flag (``Optimizer._square_sum``);
    one pass (``hostadam.square_sum``)."""
    return hostadam.square_sum(grad)


class GradTier:
    """The local groups' reduced gradients, each in its swap file between landing and step.

    Args:
        swap: ``SwapState`` of the state ``"grad"`` (compute dtype; no meter: landing runs
            on the reduction's helper thread, so the bytes are counted by ``take``).
        slots: The local groups in plan order (the order ``take`` is called in).
        ahead: Elements of gradient read ahead of the group being stepped (at least one group).
        meter: The optimizer's ``MemoryMeter`` (held bytes of the buffers ``take`` returns).
        keep: Bytes of partitions kept in memory from landing to ``take`` instead of going
            through their swap files (the first to land while they fit; 0: none). The same
            values either way: only the bytes moved change.
    """

    def __init__(self, swap, slots: list[Slot], *, ahead: int, meter, keep: int = 0) -> None:
        self.swap, self.slots, self.ahead, self.meter = swap, slots, ahead, meter
        self.keep, self._kept = keep, {}  # slot -> its partition, kept in memory
        self._landing: dict[Slot, list] = {}  # slot -> [buffer, columns landed]
        self._sums: dict[Slot, tuple[torch.Tensor, torch.Tensor]] = {}
        self._writes: list[tuple[torch.Tensor, list[Future]]] = []
        self._writing = 0  # elements of the buffers in ``_writes``
        self._lock = threading.Lock()
        self._reads: deque[tuple[Slot, torch.Tensor, list[Future]]] = deque()
        self._next = 0  # the next slot (in ``slots`` order: the step's) whose read is not started

    # ------------------------------------------------------------------ landing
    def land(self, slot: Slot, a: int, b: int, values: torch.Tensor) -> None:
        """Columns [a, b) of ``slot``'s reduced gradient (thread-safe across slots); the
        last columns to land finish the partition: its sums, then its write."""
        self.land_into(slot, a, b, lambda dst: dst.copy_(values))

    def land_into(self, slot: Slot, a: int, b: int, fill: Callable[[torch.Tensor], object]) -> None:
        """``land``, the columns written by ``fill(view of the landing buffer)``."""
        with self._lock:
            entry = self._landing.get(slot)
            if entry is None:
                entry = self._landing[slot] = [self.swap.buffers(slot)["grad"], 0]
        fill(entry[0][a:b])
        with self._lock:
            entry[1] += b - a
            done = entry[1] == slot.shard
            if done:
                del self._landing[slot]
        if done:
            self._finish_landing(slot, entry[0])

    def _finish_landing(self, slot: Slot, buf: torch.Tensor) -> None:
        sums = square_sum(buf)
        with self._lock:
            self._sums[slot] = sums
            self._kept.pop(slot, None)  # a step skipped on overflow never took it
            if sum(nbytes(b) for b in self._kept.values()) + nbytes(buf) <= self.keep:
                self._kept[slot] = buf
                return
        futures = self.swap.write(slot, {"grad": buf})
        with self._lock:
            self._writes.append((buf, futures))
            self._writing += buf.numel()
        self._reap()

    def _reap(self) -> None:
        """Free the buffers of finished writes, oldest first; while more than ``ahead``
        elements are being written, wait for the oldest (the reduction slows to the disk's
        pace instead of holding every partition of the step)."""
        while True:
            with self._lock:
                if not self._writes:
                    return
                buf, futures = self._writes[0]
                if self._writing <= self.ahead and not all(f.done() for f in futures):
                    return
                self._writes.pop(0)
                self._writing -= buf.numel()
            self.swap.wait(futures)

    def finish(self) -> None:
        """After the reduction: every partition landed and written (buffers freed)."""
        if self._landing:
            missing = sorted(s.group.name for s in self._landing)[:3]
            raise AssertionError(f"gradient partitions reduced in part: {missing}")
        while self._writes:
            self.swap.wait(self._writes.pop(0)[1])
        self._writing = 0

    def sums(self, slot: Slot) -> tuple[torch.Tensor, torch.Tensor]:
        """``square_sum`` of ``slot``'s last reduced gradient."""
        return self._sums[slot]

    # ------------------------------------------------------------------ stepping
    def take(self, slot: Slot) -> tuple[torch.Tensor, int]:
        """``slot``'s reduced gradient in a fresh host buffer and the bytes it holds (held on
        the meter; the caller drops them). Groups are taken in ``slots`` order; reads run ahead."""
        buf = self._kept.pop(slot, None)
        if buf is not None:  # kept in memory: the reads ahead go on after it
            self._next = max(self._next, self.slots.index(slot) + 1)
        else:
            if not self._reads or self._reads[0][0] is not slot:
                self._restart(slot)
            self._read_ahead()
            _, buf, futures = self._reads.popleft()
            self.swap.wait(futures)
        self._read_ahead()
        self.meter.hold(nbytes(buf))
        return buf, nbytes(buf)

    def _restart(self, slot: Slot) -> None:
        """Out of order (a new step, or ``load``): forget reads in flight, start at ``slot``."""
        self.drain()
        self._next = self.slots.index(slot)

    def _read_ahead(self) -> None:
        in_flight = sum(s.shard for s, _, _ in self._reads)
        while self._next < len(self.slots) and (not self._reads or in_flight < self.ahead):
            slot = self.slots[self._next]
            if slot in self._kept:  # in memory: nothing to read
                self._next += 1
                continue
            buf = self.swap.buffers(slot)["grad"]
            self._reads.append((slot, buf, self.swap.read(slot, {"grad": buf})))
            in_flight += slot.shard
            self._next += 1

    def drain(self) -> None:
        """Wait for (and drop) the reads in flight."""
        while self._reads:
            self.swap.wait(self._reads.popleft()[2])
        self._next = len(self.slots)

    def load(self, slot: Slot) -> torch.Tensor:
        """``slot``'s reduced gradient read now (inspection: ``full_gradients``)."""
        self.drain()
        if slot in self._kept:
            return self._kept[slot].clone()
        return self.swap.load(slot)["grad"]
