"""ZeRO stage 0: plain data parallelism with replicated fp32 optimizer state.

Every rank keeps the whole state of its optimizer groups: the parameters and their full
gradients are views of one flat buffer per data-parallel kind (``moezero.zero.flat``), and
each group (``Slot``) holds its fp32 master (in fp32, the group's range of the flat params
itself), exp_avg and exp_avg_sq over all of its elements. The gradients are all-reduced in
fp32 buckets (``moezero.zero.reduce``, one row per group): dense gradients averaged over the W
ranks, expert gradients summed over their EDP group and divided by W, so every rank computes
the gradient of the *global* mean loss (docs/design.md, "Semantics"). The step is the shared one
(``moezero.zero.optimizer``): the grad norm counts each rank's own partition range of every
group (so it equals the sharded stages' norm), then every rank steps every group and
downcasts the master into its params; nothing is gathered. A checkpoint receives this rank's
partition range of each group (the same ranges a sharded run writes) and, on load, fills every
rank's range. Reference counterpart: ``reference/optim.py``.
"""

from __future__ import annotations

import torch
from torch import nn

from moezero.distributed.topology import Topology
from moezero.zero.buckets import full_columns
from moezero.zero.frozen import FrozenWeights
from moezero.zero.groups import OptimizerGroups
from moezero.zero.optimizer import Optimizer
from moezero.zero.options import ZeroOptions
from moezero.zero.shards import Slot

__all__ = ["ReplicatedOptimizer"]


class ReplicatedOptimizer(Optimizer):
    """Replicated optimizer state, all-reduced gradients and the (tiled) step for stage 0."""

    clone_fp32_grads = False  # the full gradients are dropped after the step: use them in place

    def __init__(self, params: dict[str, nn.Parameter], groups: OptimizerGroups,
                 topology: Topology, options: ZeroOptions):
        super().__init__(params, topology, options)
        self._build_buffers(groups, full_columns, flat=True, full_grads=True)
        flat = {slot: kind for kind in self.kinds for slot in kind.slots}
        for slot in self.slots:
            self._init_state(slot, flat[slot].params, flat[slot].grads)
        for slot in self.frozen:  # weights only: a view of the flat params, nothing else
            slot.param = flat[slot].params[slot.offset:slot.offset + slot.numel]
        self._build_views(FrozenWeights(self.frozen))
        self._build_reduction(options, all_reduce=True, release=False)

    def _init_state(self, slot: Slot, params: torch.Tensor, grads: torch.Tensor) -> None:
        """The group's views of the flat params and gradients, its fp32 master (the params'
        range itself in fp32) and zero moments."""
        slot.param = params[slot.offset:slot.offset + slot.numel]
        slot.grad = grads[slot.offset:slot.offset + slot.numel]
        slot.master = slot.param.float()
        slot.exp_avg = torch.zeros_like(slot.master)
        slot.exp_avg_sq = torch.zeros_like(slot.master)
        self.meter.add_persistent(slot.exp_avg, slot.exp_avg_sq)
        if slot.master is not slot.param:
            self.meter.add_persistent(slot.master)

    def _local(self, slot: Slot) -> tuple[int, int]:
        return slot.rank_range(slot.dp_rank)

    def _load_ranges(self, slot: Slot) -> list[tuple[int, int, int]]:
        return [(d, *slot.rank_range(d)) for d in range(slot.partition.dp_size)]

    def _downcast(self, slot: Slot, master: torch.Tensor) -> None:
        if master is not slot.param:
            slot.param.copy_(master)

    def _downcast_target(self, slot: Slot, master: torch.Tensor) -> torch.Tensor | None:
        """bf16/fp16 on the host: the AdamW pass writes the params' view itself."""
        if master is slot.param or slot.param.is_cuda:
            return None
        return slot.param

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """The reduced gradients by FQN (after ``reduce_gradients``)."""
        return {fqn: p.grad for fqn, p in self.trained.items()}

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """The parameters by FQN: the params themselves."""
        return dict(self.params)

    def layout(self) -> list[dict]:
        """What is stepped, per local group in plan order: members, this rank's partition
        range (its part of the grad norm and of checkpoints) and state sizes (the group)."""
        return [{"index": slot.group.plan.index, "name": slot.group.name,
                 "kind": kind.name, "offset": slot.offset,
                 "members": [(m.fqn, m.start, m.stop) for m in slot.group.members],
                 "dp_rank": slot.dp_rank, "range": slot.partition.rank_range(slot.dp_rank),
                 "ranks": list(slot.partition.ranks), "master": slot.numel,
                 "exp_avg": slot.numel, "exp_avg_sq": slot.numel, "grad": slot.grad.numel()}
                for slot, kind in sorted(((s, k) for k in self.kinds for s in k.slots),
                                         key=lambda sk: sk[0].group.plan.index)]
