"""The optimizer state as checkpoints and exports see it: this rank's shards to save, the
targets a load fills, and the element pieces of every param (``moezero.zero.optimizer.Optimizer``
has it as a base, as it has ``FrozenWeights``; the stage-specific ranges are its methods).
A step running behind the forward (``zero.behind``) is finished first.
"""

from __future__ import annotations

from collections.abc import Iterator

from moezero.plan.layout import STATES
from moezero.zero.frozen import FrozenWeights
from moezero.zero.shards import StateShard


class StateView(FrozenWeights):
    """``shards``, ``load_targets`` and ``state_pieces`` of an optimizer's trained slots."""

    def shards(self, *, frozen: bool = True) -> list[StateShard]:
        """What this rank saves: its fp32 range of every local group, in plan order (views of
        the live state, or with NVMe offload the swap files, which hold the same range); of a
        frozen group its weights only."""
        self.finish_step()
        out = self._swapped_shards() if self.optim_swap is not None else []
        for slot, st in self._states() if self.optim_swap is None else ():
            lo, hi = self._local(slot)
            out.append(StateShard(slot.partition, slot.dp_rank,
                                  tensors={s: t[lo:hi] for s, t in st.items()}))
        return out + list(self._frozen_shards(load=False) if frozen else ())

    def load_targets(self, *, trained: bool = True, frozen: bool = True) -> Iterator[StateShard]:
        """What this rank fills from a checkpoint: every DP rank's range it holds (views of
        the live state, or the swap files), of the trained and/or the frozen groups; call
        ``after_load`` once they are filled."""
        self.finish_step()
        if trained and self.optim_swap is not None:
            yield from self._swapped_shards()
        elif trained:
            for slot, st in self._states():
                for d, lo, hi in self._load_ranges(slot):
                    yield StateShard(slot.partition, d,
                                     tensors={s: t[lo:hi] for s, t in st.items()})
        yield from self._frozen_shards(load=True) if frozen else ()

    def _swapped_shards(self) -> list[StateShard]:
        return [StateShard(slot.partition, slot.dp_rank,
                           files={s: self.optim_swap.path(slot, s) for s in STATES})
                for slot in self.slots]

    def state_pieces(self):
        """(Slice of a param, {"master", "exp_avg", "exp_avg_sq": views}) for every element
        range this rank owns, in plan order (padding omitted)."""
        for slot, st in self._read_states():
            base = self._local(slot)[0]
            for piece, at in slot.partition.rank_slices(slot.dp_rank):
                yield piece, {name: t[base + at:base + at + piece.numel]
                              for name, t in st.items()}
