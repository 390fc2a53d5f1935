"""ZeRO stages 1-3: sharded fp32 state, reduce-scattered gradients, the all-gather after the step.

**Layout.** At stages 1-2 the model's compute-dtype parameters are views into flat buffers,
one per data-parallel *kind* (``moezero.zero.flat``): the dense params (sharded over all W
ranks) and, for each moe group, the experts of this rank's EP rank (sharded over its EDP group
of W/ep ranks). Nothing else holds the params' storage.

**Partitions.** For every group this rank owns ``Partition.rank_range(dp_rank)`` of the padded
group (``shard_numel`` elements; padding, at the end of the last shards, stays zero): the fp32
master, exp_avg and exp_avg_sq, and the reduced gradient in the compute dtype. In fp32 with
the state in memory beside the params, the master is no copy: it is this rank's range of the
flat params (real elements only), as at stage 0 and stage 3, so fp32 keeps 12 B of state per
owned element, not 16. Stage 1 also
keeps the full local gradients in one flat buffer per kind that ``param.grad`` views (autograd
accumulates micro-batches into it in place) and takes its partition from the reduction;
stage 2 keeps only the partition and frees each ``param.grad`` as soon as it has been sent.

**Reduction** (``moezero.zero.reduce``): bucketed fp32 reduce-scatters into the grad
partitions, launched from gradient hooks during the last micro-batch's backward.

**Step** (``moezero.zero.optimizer.Optimizer.step``): the shared tiled step on the partitions;
the updated master is downcast into the grad partition's storage, and finally the updated
params are all-gathered in buckets across groups (``moezero.zero.allgather``: the plan's
``plan_gathers``, ``allgather_bucket_size`` elements each), so the number of all-gathers does not
grow with the number of groups; a bucket that is one whole unpadded group lands straight in the
flat buffer, others go through a receive buffer of the bucket's size.

**Stage 3** keeps no flat buffer: each param keeps its own storage, freed between uses, and
each group's shard of the params (``Slot.param``, the master itself in fp32) is gathered by
``moezero.zero.gather.ParamGatherer`` around each module (it receives the slots, the params and
``param_shard`` as its fetch function and, with NVMe params, the swap files' ``hint`` to read
the next units' shards ahead); the step ends with the downcast into the shard, no all-gather.
**Offload** (docs/offload.md): the fp32 state lives on ``state_device`` (the host for ``cpu``)
or, for ``nvme``, in swap files handed in by the engine (``swap_factory``:
``offload_state.SwapState`` objects held in a ``zero.swaps.Swaps``, so this layer never imports
``offload``); ``zero.states.OptimizerStates`` yields each group's state in plan order, from
memory or read ahead from the swap files and written back behind the step. At stage 3 with the
optimizer on NVMe the reduced gradients go to swap files too (``moezero.zero.gradtier``):
``Slot.grad`` stays None, a group's partition lives in memory only while it lands and while it
is stepped.
Reference counterpart: ``reference/plan/partition.py`` and ``reference/zero.py``.
"""

from __future__ import annotations

import torch
from torch import nn

from moezero.distributed.topology import Topology, gather_groups
from moezero.zero.allgather import gather_all
from moezero.zero.behind import StepBehind
from moezero.zero.buckets import plan_gathers, scatter_columns
from moezero.zero.frozen import FrozenWeights
from moezero.zero.gather import ParamGatherer
from moezero.zero.gradtier import GradTier
from moezero.zero.groups import OptimizerGroups
from moezero.zero.optimizer import Optimizer
from moezero.zero.options import ZeroOptions
from moezero.zero.shards import Slot, read_members
from moezero.zero.swaps import build_swaps

__all__ = ["ShardedOptimizer"]


class ShardedOptimizer(Optimizer):
    """Sharded optimizer state, gradient reduction and the (tiled) step for stages 1-3.

    Args:
        params, groups, topology: The model's params by FQN, the plan's groups, the ranks.
        stage: 1 (shard the state), 2 (and the gradients) or 3 (and the params).
        options: Reduction and all-gather buckets, reduce dtype, the offloaded step's window.
        model: Stage 3 only: its modules are the gather units.
        state_device, param_device: Where the fp32 state / stage-3 param shards live in
            memory (the params' device, or the host for ``cpu`` offload).
        swap_factory: ``(slots, meter) -> (optimizer, param, grad SwapState or None each)``
            for NVMe offload (``moezero.offload.state.build``; grad: stage 3 only, the
            gradient tier ``moezero.zero.gradtier``).
        initial: FQN -> the param's initial value, read instead of the params (stage 3 with
            params built without storage: ``moezero.model.materialize``).
    """

    def __init__(self, params: dict[str, nn.Parameter], groups: OptimizerGroups,
                 topology: Topology, options: ZeroOptions, *, stage: int,
                 model: nn.Module | None = None, prefetch: bool = True,
                 state_device: torch.device | None = None, param_device: torch.device | None = None,
                 swap_factory=None, initial=None):
        if stage not in (1, 2, 3):
            raise ValueError(f"zero_optimization.stage: ShardedOptimizer runs 1-3, got {stage}")
        if stage == 3 and model is None:
            raise ValueError("stage 3 needs the model (its modules are the gather units)")
        super().__init__(params, topology, options)
        self.stage = stage
        self._build_buffers(groups, scatter_columns, flat=stage < 3, full_grads=stage == 1)
        # Offload: where the fp32 state and the stage-3 param shards live in memory (the
        # device, or the host for 'cpu'), or swap files (``offload.state.SwapState``).
        self.state_device = state_device or self._device
        self.param_device = param_device or self._device
        self.swaps = build_swaps(swap_factory, self.slots, self.meter, self.frozen)
        if self.swaps.grad is not None:
            self.grad_tier = GradTier(self.swaps.grad, self.slots, ahead=options.host_window,
                                      meter=self.meter, keep=options.keep_grads)
        self._initial = initial or (lambda fqn: self.params[fqn].data)
        self._init_state()
        self._initial = None  # drops the init source's cached param
        self._build_views(FrozenWeights(self.frozen, sharded=stage == 3,
                                        swap=self.param_swap if stage == 3 else None))
        self._plan_host_step(options)
        self._build_reduction(options, all_reduce=False, release=stage >= 2)
        self.bucket_size = options.allgather_bucket_size
        self.read_in_backward = options.read_in_backward
        self.gather_plan = plan_gathers([(i, s.channel, s.columns) for i, s in enumerate(self.slots)],
                                        options.allgather_bucket_size)
        self.gatherer = None
        if stage == 3:
            swap = self.param_swap
            self.gatherer = ParamGatherer(model, params, self.slots + self.frozen, self.param_shard,
                                          gather_groups(topology),
                                          prefetch=prefetch,
                                          prefetch_max_bytes=options.prefetch_max_bytes,
                                          bucket_size=options.allgather_bucket_size,
                                          hint=swap.hint if swap is not None else None,
                                          read_ahead=options.param_read_ahead,
                                          keep_bytes=options.param_keep_for_backward)
            if options.step_in_forward and swap is not None and self.host_windows:
                self._step_in_forward_order(options)

    # ------------------------------------------------------------------ construction
    def _step_in_forward_order(self, options: ZeroOptions) -> None:
        """``step_in_forward``: step the groups in the order the next forward first gathers
        them (its units' order), so each gather finds its group stepped, and handed over,
        soonest; the gradient tier reads ahead in that order too. The masters handed over
        and not yet gathered are bounded like the reads ahead they replace: ``read_ahead``
        units (at least one) of this rank's shards, or two windows."""
        units, size = self.gatherer.units, self.param_swap.dtype.itemsize
        first = dict.fromkeys(i for unit in units for i in unit.slots if i < len(self.slots))
        unit_bytes = max(sum(size * self.slots[i].shard for i in u.slots if i < len(self.slots))
                         for u in units)
        window_bytes = max(size * sum(s.shard for s in w) for w in self.host_windows)
        self.behind = StepBehind(self.param_swap, max(max(1, options.param_read_ahead)
                                                      * unit_bytes, 2 * window_bytes))
        order = [self.slots[i] for i in first]
        order += [s for i, s in enumerate(self.slots) if i not in first]
        self._plan_host_step(options, order)
        if self.grad_tier is not None:
            self.grad_tier.slots = order

    def _init_state(self) -> None:
        """fp32 master (this rank's shard of the params, zero padding) and zero moments, in
        memory or swap files; at stage 3 also the compute-dtype param shard (in fp32 and on
        the same device, the master itself). At stages 1-2 in fp32 with the state in memory
        on the params' device, the master is no copy but this rank's range of the flat
        params, without the padding (``numel`` may be less than ``shard``)."""
        dtype = next(iter(self.params.values())).dtype
        master_is_param = self.stage < 3 and dtype == torch.float32 \
            and self.optim_swap is None and self.state_device == self._device
        flat = {slot: kind.params for kind in self.kinds for slot in kind.slots}
        for slot in self.slots:
            if self.grad_tier is None:  # else the gradient exists while it lands only
                slot.grad = torch.zeros(slot.shard, dtype=dtype, device=self._device)
                self.meter.add_persistent(slot.grad)
            if master_is_param:
                self._init_master_in_params(slot, flat[slot])
            else:
                self._init_master_copy(slot, dtype)
        for slot in self.frozen:
            if self.stage < 3:  # weights only: the group's range of the flat params
                slot.param = flat[slot][slot.offset:slot.offset + slot.numel]
            else:
                self._init_frozen_shard(slot, dtype)

    def _init_frozen_shard(self, slot: Slot, dtype: torch.dtype) -> None:
        """Stage 3, a frozen group: this rank's shard of its params in the compute dtype
        (zero padding) on ``param_device`` or in its param swap file; nothing else. A slot
        read in place from its base (``offload.base_params``) has no value to draw: the base
        is loaded before the first step, and its drawn values would be thrown away."""
        if self.param_swap is not None and slot in self.param_swap.sources:
            return
        lo, hi = slot.rank_range(slot.dp_rank)
        shard = torch.zeros(slot.shard, dtype=dtype, device=self._device)
        if lo < hi:
            read_members(slot.columns, lo, hi, shard, self._initial)
        if self.param_swap is not None:
            self.param_swap.put(slot, {"param": shard})
            return
        slot.param = self._host_or_device(shard, self.param_device)
        self.meter.add_persistent(slot.param)

    def _init_master_in_params(self, slot: Slot, flat: torch.Tensor) -> None:
        """fp32 in memory: the master is this rank's range of the flat params."""
        lo, hi = slot.rank_range(slot.dp_rank)
        slot.master = flat[slot.offset + lo:slot.offset + hi]
        slot.exp_avg = torch.zeros(slot.shard, dtype=torch.float32, device=self._device)
        slot.exp_avg_sq = torch.zeros_like(slot.exp_avg)
        self.meter.add_persistent(slot.exp_avg, slot.exp_avg_sq)

    def _init_master_copy(self, slot: Slot, dtype: torch.dtype) -> None:
        """The master as an fp32 copy of the shard (padded), in memory or a swap file."""
        lo, hi = slot.rank_range(slot.dp_rank)
        master = torch.zeros(slot.shard, dtype=torch.float32, device=self._device)
        if lo < hi:
            read_members(slot.columns, lo, hi, master, self._initial)
        if self.stage == 3:
            self._init_param_shard(slot, master, dtype)
        if self.optim_swap is not None:
            self.optim_swap.put(slot, {"master": master, "exp_avg": 0.0, "exp_avg_sq": 0.0})
            return
        slot.master = self._host_or_device(master, self.state_device)
        slot.exp_avg, slot.exp_avg_sq = torch.zeros_like(slot.master), torch.zeros_like(slot.master)
        self.meter.add_persistent(slot.master, slot.exp_avg, slot.exp_avg_sq)
        if self.stage == 3 and slot.param is None and dtype == torch.float32 \
                and self.param_swap is None and self.param_device == self.state_device:
            slot.param = slot.master

    def _init_param_shard(self, slot: Slot, master: torch.Tensor, dtype: torch.dtype) -> None:
        if self.param_swap is not None:
            self.param_swap.put(slot, {"param": master})
        elif dtype != torch.float32 or self.optim_swap is not None \
                or self.param_device != self.state_device:
            slot.param = self._host_or_device(master.to(dtype), self.param_device)
            self.meter.add_persistent(slot.param)

    def _host_or_device(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``t`` on ``device``; host copies are pinned only when CUDA is used (CPU builds of
        torch refuse ``pin_memory``)."""
        if device == t.device:
            return t
        return self.transfer.pinned_copy(t) if self.transfer.pin else t.to(device)

    # ------------------------------------------------------------------ hooks and exit
    def before_backward(self, *, final: bool) -> None:
        """Before each micro-batch's backward; before the step's last one, with
        ``read_in_backward``, the step's first windows of swapped state start their reads."""
        super().before_backward(final=final)
        if final and self.read_in_backward and self.optim_swap is not None and self.host_windows:
            self.optim_swap.read_early(self.host_windows, self.read_in_backward)

    def after_backward(self) -> None:
        """Called after each micro-batch's backward: stage 3 releases what it still holds."""
        if self.gatherer is not None:
            self.gatherer.after_backward()

    def close(self) -> None:
        """Drop gathers in flight and remove the swap files (a clean exit)."""
        self.finish_step()
        if self.gatherer is not None:
            self.gatherer.drain()
        if self.grad_tier is not None:
            self.grad_tier.drain()
        self.swaps.close()

    def after_load(self) -> None:
        """The swap files were filled behind the I/O engine's back: reopen them; then derive
        the params from the masters (collective)."""
        self.finish_step()
        if self.optim_swap is not None:
            self.optim_swap.reopen()
        self.params_from_master()

    # ------------------------------------------------------------------ the step's ends
    def _local(self, slot: Slot) -> tuple[int, int]:
        return 0, slot.shard

    def _load_ranges(self, slot: Slot) -> list[tuple[int, int, int]]:
        return [(slot.dp_rank, 0, slot.shard)]

    def _downcast(self, slot: Slot, master: torch.Tensor) -> None:
        """The updated master into the compute dtype: at stage 3 the param shard (memory or
        swap file), else the grad partition's storage (the all-gather's source)."""
        if self.stage == 3 and self.param_swap is not None:
            self.param_swap.put(slot, {"param": master})
            return
        target = slot.param if self.stage == 3 else slot.grad
        if target is not master:  # a host master to the device: non-blocking on CUDA
            self.transfer.copy(target[:master.numel()], master)

    def _downcast_target(self, slot: Slot, master: torch.Tensor) -> torch.Tensor | None:
        """What ``_downcast`` fills, when it is host memory other than the master: the AdamW
        pass writes it (None: a swap file, the master itself, or device memory)."""
        if self.stage == 3 and self.param_swap is not None:
            return None
        target = slot.param if self.stage == 3 else slot.grad
        if target is None or target is master or target.is_cuda or master.is_cuda:
            return None
        return target[:master.numel()]

    def _after_step(self) -> None:
        self.transfer.finish()  # what follows reads the copied params on the compute stream
        if self.stage < 3:
            self._gather(lambda slot: slot.grad, [k.params for k in self.kinds])
        else:
            self.gatherer.read_ahead_start()  # the shards are written: read the first units

    def param_shard(self, slot: Slot) -> torch.Tensor:
        """Stage 3: ``slot``'s param shard on the compute device (read from its swap file, or
        copied from the host, when offloaded), the source of its all-gather."""
        if self.param_swap is not None:
            return self.transfer.fetch(self.param_swap.load(slot)["param"])
        return self.transfer.fetch(slot.param)

    def _gather(self, shard_of, dest: list[torch.Tensor], slots: list[Slot] | None = None) -> None:
        """All-gather every group's shard (``shard_of(slot)``) into the flat buffers ``dest``,
        bucket by bucket (``gather_plan``: ``allgather_bucket_size`` elements each, two in
        flight); a bucket that is one whole unpadded group lands in the buffer directly.
        ``slots``: those groups (default: the trained ones, whose plan is kept)."""
        plan = self.gather_plan
        if slots is None:
            slots = self.slots
        else:
            plan = plan_gathers([(i, s.channel, s.columns) for i, s in enumerate(slots)],
                                self.bucket_size)
        kind_of = {slot: k for k, kind in enumerate(self.kinds) for slot in kind.slots}
        regions = [dest[kind_of[s]][s.offset:s.offset + s.numel] for s in slots]
        channels = {kind.channel: kind.group for kind in self.kinds}
        gather_all(plan, [s.columns for s in slots],
                   lambda i: shard_of(slots[i]), channels.get, regions, meter=self.meter)

    # ------------------------------------------------------------------ inspection
    def full_gradients(self) -> dict[str, torch.Tensor]:
        """The reduced gradients by FQN, all-gathered (collective; after ``reduce_gradients``)."""
        self.finish_step()
        if self.grad_tier is not None:
            return self._full(lambda slot: self.grad_tier.load(slot).to(self._device))
        return self._full(lambda slot: slot.grad)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """The parameters by FQN: the params themselves at stages 1-2; at stage 3 copies
        all-gathered from the shards (collective)."""
        self.finish_step()
        if self.stage < 3:
            return dict(self.params)
        return self._full(self.param_shard, self.slots + self.frozen)

    def _full(self, shard_of, slots: list[Slot] | None = None) -> dict[str, torch.Tensor]:
        """The params of ``slots`` (default: the trained ones) by FQN, gathered from
        ``shard_of(slot)``."""
        p0 = next(iter(self.params.values()))
        flats = [torch.empty(sum(s.numel for s in k.slots), dtype=p0.dtype, device=p0.device)
                 for k in self.kinds]
        self._gather(shard_of, flats, slots)
        fqns = {m.fqn for s in slots or self.slots for m in s.group.members}
        return {fqn: flats[k][pos:pos + p.numel()].view(p.shape)
                for fqn, p in self.params.items() if fqn in fqns
                for k, pos in [self.where[fqn]]}

    def layout(self) -> list[dict]:
        """What is stepped, per local group in plan order: members, shard range, state sizes
        (of the plan's shard; an fp32 master that is the params' range holds its real
        elements only)."""
        rows = []
        for kind in self.kinds:
            for slot in kind.slots:
                part = slot.partition
                rows.append({
                    "index": slot.group.plan.index, "name": slot.group.name, "kind": kind.name,
                    "offset": slot.offset,
                    "members": [(m.fqn, m.start, m.stop) for m in slot.group.members],
                    "dp_rank": slot.dp_rank, "range": part.rank_range(slot.dp_rank),
                    "ranks": list(part.ranks), "master": slot.shard,
                    "exp_avg": slot.shard, "exp_avg_sq": slot.shard,
                    "grad": slot.grad.numel() if slot.grad is not None else 0})
        return sorted(rows, key=lambda r: r["index"])
