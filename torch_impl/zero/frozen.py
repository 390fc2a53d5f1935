"""The frozen groups' weights as checkpoints see them (``train.freeze``, docs/grouping.md).

A frozen group's params live in the compute dtype only (the group's range of its kind's flat
params at stages 0-2, this rank's shard at stage 3, on the host or in a param swap file with
offload): there is no fp32 master to hand a checkpoint. ``FrozenWeights`` (owned by
``moezero.zero.optimizer.Optimizer``) turns them into fp32 ``master`` shards for a save and
back for a load; it is told at construction whether the slots hold the whole group or this
rank's shard, and receives the param swap files where they are swapped.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch

from moezero.plan.state_shard import StateShard
from moezero.zero.shards import Slot

__all__ = ["FrozenWeights", "ParamFiles"]


class ParamFiles(Protocol):
    """What ``FrozenWeights`` uses of the param swap files (``offload.state.SwapState``)."""

    def load(self, slot: Slot) -> dict[str, torch.Tensor]: ...

    def put(self, slot: Slot, values: dict[str, torch.Tensor]) -> None: ...

    def drop(self, bufs: dict[str, torch.Tensor]) -> None: ...


class FrozenWeights:
    """Checkpoint shards of the frozen slots of an optimizer.

    Args:
        slots: The frozen groups' slots, in plan order (their ``param``: the group's range of
            the flat params, or with ``sharded`` this rank's padded shard).
        sharded: Stage 3: a slot holds this rank's shard only (saved and loaded as it is);
            else the whole group (this rank's range saved, every rank's loaded).
        swap: Stage 3 with NVMe params: the param swap files holding the shards.
    """

    def __init__(self, slots: list[Slot], *, sharded: bool = False,
                 swap: ParamFiles | None = None) -> None:
        self.slots, self.sharded, self.swap = slots, sharded, swap

    def shards(self, *, load: bool) -> Iterator[StateShard]:
        """The frozen groups' weights as fp32 ``master`` shards: views of the params in fp32,
        else fp32 copies that, on ``load``, go back into the params once the consumer has
        filled them (the generator resumes after each target is read)."""
        for slot in self.slots:
            param = self._param(slot)
            for d, lo, hi in self._ranges(slot, load=load):
                view = param[lo:hi]
                t = view.float()
                yield StateShard(slot.partition, d, tensors={"master": t})
                if load and t is not view:
                    view.copy_(t)
            self._stored(slot, param, changed=load)

    def _param(self, slot: Slot) -> torch.Tensor:
        """The compute-dtype tensor that holds a frozen slot's params."""
        if self.swap is not None:
            return self.swap.load(slot)["param"]
        return slot.param

    def _ranges(self, slot: Slot, *, load: bool) -> list[tuple[int, int, int]]:
        """(DP rank, lo, hi) of ``_param`` saved (this rank's) or loaded (every rank's, when
        the whole group is held)."""
        if self.sharded:  # this rank's shard, padding included
            return [(slot.dp_rank, 0, slot.shard)]
        ranks = range(slot.partition.dp_size) if load else (slot.dp_rank,)
        return [(d, *slot.rank_range(d)) for d in ranks]

    def _stored(self, slot: Slot, param: torch.Tensor, *, changed: bool) -> None:
        """Done with ``_param(slot)`` (``changed``: it was loaded): back to its swap file."""
        if self.swap is not None:
            if changed:
                self.swap.put(slot, {"param": param})
            self.swap.drop({"param": param})
