"""Swap file reads started before they are needed: the read-ahead of stage-3 param shards.

The stage-3 gatherer (``moezero.zero.gather.ParamGatherer``) knows which units come next; it
*hints* their groups (``SwapState.hint``, nearest first) and ``ReadAhead`` starts their reads on
the I/O engine's threads into fresh host buffers, so that when a unit's gather fetches a shard
(``SwapState.load``) it is in memory or on its way, and the disk works while earlier units
compute. Each hint replaces the previous one: a buffer not hinted again is dropped (its read
awaited first), so the buffers alive are those of the latest hint, which the gatherer bounds
(``read_ahead`` units). A write to a slot first forgets its read-ahead (awaited, dropped): a
read never races a write and never returns bytes older than the last write. Buffers are pinned
where CUDA is available (``SwapState.buffers``), so the copy to the device stays non-blocking.
Reference counterpart: none (the reference keeps every state in memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future


class ReadAhead:
    """Reads started for hinted slots of one ``SwapState``, held until taken or forgotten.

    Args:
        swap: The swap files (``buffers``, ``read``, ``drop``: ``moezero.offload.state``).

    ``stats``: ``ahead`` (loads served by a read-ahead), ``sync`` (loads read on demand),
    ``dropped`` (read-ahead buffers dropped unused), ``peak_bytes`` (most bytes of read-ahead
    buffers alive at once, taken ones excluded).
    """

    def __init__(self, swap):
        self.swap = swap
        self.pending: dict[object, tuple[dict, list[Future]]] = {}  # slot -> (buffers, reads)
        self.stats = {"ahead": 0, "sync": 0, "dropped": 0, "peak_bytes": 0}

    def hint(self, slots: Sequence) -> None:
        """Read ``slots`` ahead (nearest first); forget every earlier hint not among them."""
        keep = set(slots)
        for slot in [s for s in self.pending if s not in keep]:
            self.forget(slot)
            self.stats["dropped"] += 1
        for slot in slots:  # one a step behind the forward rewrites, or handed over: not read
            if slot not in self.pending and self.swap.written(slot) \
                    and slot not in self.swap.offered:
                bufs = self.swap.buffers(slot)
                self.pending[slot] = (bufs, self.swap.read(slot, bufs))
        self.stats["peak_bytes"] = max(self.stats["peak_bytes"], self.nbytes())

    def take(self, slot) -> dict | None:
        """``slot``'s buffers once its read-ahead is done (now the caller's), or None."""
        got = self.pending.pop(slot, None)
        self.stats["ahead" if got else "sync"] += 1
        if got is None:
            return None
        self.swap.wait(got[1])
        return got[0]

    def forget(self, slot) -> None:
        """Drop ``slot``'s read-ahead, if any, once its read is done (before a write)."""
        got = self.pending.pop(slot, None)
        if got is not None:
            self.swap.wait(got[1])
            self.swap.drop(got[0])

    def nbytes(self) -> int:
        """Bytes of the read-ahead buffers alive."""
        return sum(b.nbytes for bufs, _ in self.pending.values() for b in bufs.values())
