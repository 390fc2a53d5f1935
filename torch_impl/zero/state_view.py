"""The optimizer state as checkpoints and exports see it: this rank's shards to save, the
targets a load fills, and the element pieces of every param. ``StateView`` is owned by
``moezero.zero.optimizer.Optimizer`` and built from what it needs: the trained groups' states
(``zero.states.OptimizerStates``), the frozen groups' weights (``zero.frozen.FrozenWeights``),
the stage's ranges (which range of a slot's tensors is this rank's own, which a load fills)
and the function that finishes a step running behind the forward (``zero.behind``), called
first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from moezero.plan.state_shard import StateShard
from moezero.zero.frozen import FrozenWeights
from moezero.zero.shards import Slot
from moezero.zero.states import OptimizerStates

__all__ = ["StateView"]


class StateView:
    """``shards``, ``load_targets`` and ``state_pieces`` of an optimizer's slots.

    Args:
        states: The trained groups' fp32 states.
        frozen: The frozen groups' weights.
        local: ``slot -> (lo, hi)``: this rank's own range within the slot's state tensors.
        load_ranges: ``slot -> [(DP rank, lo, hi)]``: the ranges of the slot's state tensors
            a load fills.
        finish: Waits for a step running behind the forward (raises what it failed with).
    """

    def __init__(self, states: OptimizerStates, frozen: FrozenWeights, *,
                 local: Callable[[Slot], tuple[int, int]],
                 load_ranges: Callable[[Slot], list[tuple[int, int, int]]],
                 finish: Callable[[], None]) -> None:
        self.states, self.frozen = states, frozen
        self.local, self.load_ranges, self.finish = local, load_ranges, finish

    def shards(self, *, frozen: bool = True) -> list[StateShard]:
        """What this rank saves: its fp32 range of every local group, in plan order (views of
        the live state, or with NVMe offload the swap files, which hold the same range); of a
        frozen group its weights only."""
        self.finish()
        swapped = self.states.swap is not None
        out = self.states.swapped_shards() if swapped else []
        for slot, st in self.states.stepping() if not swapped else ():
            lo, hi = self.local(slot)
            out.append(StateShard(slot.partition, slot.dp_rank,
                                  tensors={s: t[lo:hi] for s, t in st.items()}))
        return out + list(self.frozen.shards(load=False) if frozen else ())

    def load_targets(self, *, trained: bool = True, frozen: bool = True) -> Iterator[StateShard]:
        """What this rank fills from a checkpoint: every DP rank's range it holds (views of
        the live state, or the swap files), of the trained and/or the frozen groups; the
        optimizer's ``after_load`` follows once they are filled."""
        self.finish()
        if trained and self.states.swap is not None:
            yield from self.states.swapped_shards()
        elif trained:
            for slot, st in self.states.stepping():
                for d, lo, hi in self.load_ranges(slot):
                    yield StateShard(slot.partition, d,
                                     tensors={s: t[lo:hi] for s, t in st.items()})
        yield from self.frozen.shards(load=True) if frozen else ()

    def state_pieces(self):
        """(Slice of a param, {"master", "exp_avg", "exp_avg_sq": views}) for every element
        range this rank owns, in plan order (padding omitted)."""
        self.finish()
        for slot, st in self.states.read():
            base = self.local(slot)[0]
            for piece, at in slot.partition.rank_slices(slot.dp_rank):
                yield piece, {name: t[base + at:base + at + piece.numel]
                              for name, t in st.items()}
