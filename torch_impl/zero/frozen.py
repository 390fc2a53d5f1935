"""The frozen groups' weights as checkpoints see them (``train.freeze``, docs/grouping.md).

A frozen group's params live in the compute dtype only (the group's range of its kind's flat
params at stages 0-2, this rank's shard at stage 3, on the host or in a param swap file with
offload): there is no fp32 master to hand a checkpoint. ``FrozenWeights`` (a base of
``moezero.zero.optimizer.Optimizer``) turns them into fp32 ``master`` shards for a save and
back for a load; the stage-specific places are its overridable methods.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from moezero.zero.shards import Slot, StateShard


class FrozenWeights:
    """Checkpoint shards of the frozen slots (``self.frozen``) of an optimizer."""

    frozen: list[Slot]

    def _frozen_shards(self, *, load: bool) -> Iterator[StateShard]:
        """The frozen groups' weights as fp32 ``master`` shards: views of the params in fp32,
        else fp32 copies that, on ``load``, go back into the params once the consumer has
        filled them (the generator resumes after each target is read)."""
        for slot in self.frozen:
            param = self._frozen_param(slot)
            for d, lo, hi in self._frozen_ranges(slot, load=load):
                view = param[lo:hi]
                t = view.float()
                yield StateShard(slot.partition, d, tensors={"master": t})
                if load and t is not view:
                    view.copy_(t)
            self._frozen_stored(slot, param, changed=load)

    def _frozen_param(self, slot: Slot) -> torch.Tensor:
        """The compute-dtype tensor that holds a frozen slot's params (the group's range of
        the flat params; at stage 3 its shard)."""
        return slot.param

    def _frozen_ranges(self, slot: Slot, *, load: bool) -> list[tuple[int, int, int]]:
        """(DP rank, lo, hi) of ``_frozen_param`` saved (this rank's) or loaded (every
        rank's: the whole group is held)."""
        ranks = range(slot.partition.dp_size) if load else (slot.dp_rank,)
        return [(d, *slot.rank_range(d)) for d in ranks]

    def _frozen_stored(self, slot: Slot, param: torch.Tensor, *, changed: bool) -> None:
        """Done with ``_frozen_param(slot)`` (``changed``: it was loaded)."""
