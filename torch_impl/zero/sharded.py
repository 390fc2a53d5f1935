"""ZeRO stages 1-3: flat parameter buffers, sharded fp32 state and the tiled step.

**Layout.** The model's compute-dtype parameters are views into flat buffers, one per
data-parallel *kind*: the dense params (sharded over all W ranks) and, for each moe group,
the experts of this rank's EP rank (sharded over its EDP group of W/ep ranks). A kind's buffer
holds its optimizer groups back to back in plan order, each group's members contiguous in
member order (``Partition.offsets``) and *without* partition padding. The chunks of one
logical group are consecutive in plan order and of one kind, so a parameter that
``moe.max_group_size`` slices across groups stays one contiguous view. Padding lives only in
the communication buffers and in the partitions. Nothing else holds the params' storage.

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

**Step** (``step``): the global grad norm is one all-reduce of local sums of squares over the
partitions, which count each element exactly once, and of a non-finite count (fp16 overflow:
every rank skips). Then, group by group (``tiled``): upcast the grad partition to fp32 ->
unscale -> x clip coefficient -> AdamW on the master (``optim.adamw_``) -> downcast into the
grad partition's storage, so only one group's fp32 gradients are alive. The untiled step
upcasts every group first and runs the same per-group ops, hence bit-identical results.
Finally the updated params are all-gathered (``all_gather_single``) group by group,
straight into the flat buffers (a padded group goes through one temporary of its size).

**Stage 3** keeps no flat buffer: each param keeps its own storage, freed between uses, and
each group's shard of the params (``Slot.param``, the master itself in fp32) is gathered by
``moezero.zero.gather.ParamGatherer`` around each module; the step ends with the downcast into
the shard, no all-gather. **Offload** (docs/offload.md): the fp32 state lives on
``state_device`` (the host for ``cpu``) or, for ``nvme``, in swap files handed in by the
engine (``swap_factory``: ``offload_state.SwapState`` objects, so this layer never imports
``offload``); ``_states`` yields each group's state in plan order, from memory or read ahead
from the swap files and written back behind the step.

``MemoryMeter`` counts the engine's own bytes during the step: persistent partitions and
temporaries while they are alive. Reference counterpart: ``reference/plan/partition.py``.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

from moezero.distributed.topology import Topology
from moezero.zero.adamw import adamw_, clip_coef
from moezero.zero.gather import ParamGatherer
from moezero.zero.groups import LocalGroup, OptimizerGroups
from moezero.zero.reduce import GradReduction
from moezero.zero.shards import Kind, MemoryMeter, Slot, nbytes

# torch 2.13 renamed the tensor forms; older versions only have the *_tensor names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
ADAMW_TEMPORARIES = 2  # optim.adamw_ allocates m_hat and denom, each the size of its input
__all__ = ["ADAMW_TEMPORARIES", "MemoryMeter", "ZeroOptimizer", "nbytes"]


class ZeroOptimizer(GradReduction):
    """Sharded optimizer state, gradient reduction and the (tiled) step for stages 1-3."""

    def __init__(self, params: dict[str, nn.Parameter], groups: OptimizerGroups,
                 topology: Topology, *, stage: int, bucket_size: int, overlap: bool,
                 model: nn.Module | None = None, prefetch: bool = True,
                 state_device: torch.device | None = None, param_device: torch.device | None = None,
                 swap_factory=None):
        if stage not in (1, 2, 3):
            raise ValueError(f"zero_optimization.stage: ZeroOptimizer runs 1-3, got {stage}")
        if stage == 3 and model is None:
            raise ValueError("stage 3 needs the model (its modules are the gather units)")
        self.params, self.topology, self.stage = params, topology, stage
        self.meter = MemoryMeter()
        self.kinds = self._build_kinds(groups.local)
        self.slots = [s for kind in self.kinds for s in kind.slots]
        self.slots.sort(key=lambda s: s.group.plan.index)  # plan order, for the step
        # Offload: where the fp32 state and the stage-3 param shards live in memory (the
        # device, or the host for 'cpu'), or swap files (``offload_state.SwapState``).
        self.state_device = state_device or self._device
        self.param_device = param_device or self._device
        self.optim_swap, self.param_swap = swap_factory(self.slots, self.meter) if swap_factory else (None, None)
        self._where: dict[str, tuple[int, int]] = {}  # fqn -> (kind, flat position)
        for k, kind in enumerate(self.kinds):
            self._place_params(k, kind)
        if set(self._where) != set(params):
            missing = sorted(set(params) - set(self._where))[:3]
            raise AssertionError(f"params outside this rank's optimizer groups: {missing}")
        if stage == 1:
            self._attach_grad_views()
        self._init_state()
        self._init_reduction(bucket_size, overlap)
        self.gatherer = None
        if stage == 3:
            self.gatherer = ParamGatherer(self, model, topology, prefetch=prefetch)

    # ------------------------------------------------------------------ construction
    def _build_kinds(self, local: tuple[LocalGroup, ...]) -> list[Kind]:
        topo, kinds, cursor = self.topology, {}, defaultdict(int)
        for g in local:
            plan, part = g.plan, g.partition
            name = "dense" if not plan.is_expert else f"moe/{plan.moe_group}/ep{plan.ep_rank}"
            if name not in kinds:
                group = topo.edp_group(plan.ep_size) if plan.is_expert else None
                channel = f"edp{plan.ep_size}" if plan.is_expert else "world"
                kinds[name] = Kind(name, part.dp_size, group, channel, [])
            slot = Slot(g, cursor[name], part.dp_rank(topo.rank),
                         [off for _, off in part.offsets], channel=kinds[name].channel)
            kinds[name].slots.append(slot)
            cursor[name] += part.numel
        return list(kinds.values())

    def _place_params(self, k: int, kind: Kind) -> None:
        """Copy the kind's params into one flat buffer and make them views of it."""
        first = {}  # fqn -> flat position of its element 0
        for slot in kind.slots:
            for member, off in slot.group.partition.offsets:
                pos = slot.offset + off - member.start
                if first.setdefault(member.fqn, pos) != pos:
                    raise AssertionError(f"{member.fqn}: pieces are not contiguous in {kind.name}")
        self._where.update((fqn, (k, pos)) for fqn, pos in first.items())
        if self.stage == 3:  # params keep their own storage, freed by the gatherer
            return
        dtype = next(iter(self.params.values())).dtype
        numel = sum(s.numel for s in kind.slots)
        kind.params = torch.empty(numel, dtype=dtype, device=self._device)
        for fqn, pos in first.items():
            p = self.params[fqn]
            view = kind.params[pos:pos + p.numel()].view_as(p)
            view.copy_(p.detach())
            p.data = view
        if self.stage == 1:
            kind.grads = torch.zeros_like(kind.params)
            self.meter.add_persistent(kind.grads)

    @property
    def _device(self) -> torch.device:
        return next(iter(self.params.values())).device

    def _init_state(self) -> None:
        """fp32 master (this rank's shard of the params, zero padding) and zero moments, in
        memory or swap files; at stage 3 also the compute-dtype param shard (in fp32 and on
        the same device, the master itself). At stages 1-2 in fp32 with the state in memory
        on the params' device, the master is no copy but this rank's range of the flat
        params, without the padding (``numel`` may be less than ``shard``)."""
        dtype = next(iter(self.params.values())).dtype
        flat = {slot: kind.params for kind in self.kinds for slot in kind.slots}
        master_is_param = self.stage < 3 and dtype == torch.float32 \
            and self.optim_swap is None and self.state_device == self._device
        for slot in self.slots:
            lo = min(slot.dp_rank * slot.shard, slot.numel)
            hi = min(lo + slot.shard, slot.numel)
            slot.grad = torch.zeros(slot.shard, dtype=dtype, device=self._device)
            self.meter.add_persistent(slot.grad)
            if master_is_param:  # fp32 in memory: this rank's range of the flat params
                slot.master = flat[slot][slot.offset + lo:slot.offset + hi]
                slot.exp_avg = torch.zeros(slot.shard, dtype=torch.float32, device=self._device)
                slot.exp_avg_sq = torch.zeros_like(slot.exp_avg)
                self.meter.add_persistent(slot.exp_avg, slot.exp_avg_sq)
                continue
            master = torch.zeros(slot.shard, dtype=torch.float32, device=self._device)
            if lo < hi:
                self._read_members(slot, lo, hi, master, lambda fqn: self.params[fqn].data)
            if self.stage == 3:
                self._init_param_shard(slot, master, dtype)
            if self.optim_swap is not None:
                self.optim_swap.put(slot, {"master": master, "exp_avg": 0.0, "exp_avg_sq": 0.0})
                continue
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
        """``t`` on ``device``; host copies are pinned only when an accelerator is used."""
        if device == t.device:
            return t
        return t.to(device).pin_memory() if self._device.type == "cuda" else t.to(device)

    # ------------------------------------------------------------------ gradients
    def after_backward(self) -> None:
        """Called after each micro-batch's backward: stage 3 releases what it still holds."""
        if self.gatherer is not None:
            self.gatherer.after_backward()

    def close(self) -> None:
        """Drop gathers in flight and remove the swap files (a clean exit)."""
        if self.gatherer is not None:
            self.gatherer.drain()
        for swap in (self.optim_swap, self.param_swap):
            if swap is not None:
                swap.close(remove=True)

    def zero_grad(self) -> None:
        """After a step: clear the local gradients (stage 1 keeps its views, zeroed)."""
        for kind in self.kinds:
            if kind.grads is not None:
                kind.grads.zero_()
        if self.stage >= 2:
            for p in self.params.values():
                p.grad = None

    # ------------------------------------------------------------------ step
    def step(self, *, lr: float, scale: float, max_norm: float | None, step: int,
             betas: tuple[float, float], eps: float, tiled: bool) -> tuple[float, bool]:
        """Clip and AdamW-step every group on the reduced partitions, then all-gather params.

        Returns (grad norm of the unscaled gradients, overflow); on overflow nothing changes.
        """
        self.meter.start()
        upcast = None if tiled else [self._upcast(s) for s in self.slots]
        sq, nonfinite = self._square_sum(upcast)
        if nonfinite:
            for g32 in upcast or ():
                self.meter.drop(nbytes(g32))
            return float("inf"), True
        grad_norm = math.sqrt(sq) / scale
        clip = clip_coef(grad_norm, max_norm)
        for i, (slot, st) in enumerate(self._states()):
            g32 = upcast[i] if upcast is not None else self._upcast(slot)
            if upcast is not None:
                upcast[i] = None
            g32.mul_(1.0 / scale).mul_(clip)
            held = nbytes(g32)
            g32 = g32.to(self.state_device)  # offload: the step runs where the state is
            hp = slot.group.hparams
            self.meter.hold(ADAMW_TEMPORARIES * held)
            n = st["master"].numel()  # the shard, or its real elements (master = params)
            adamw_(st["master"], g32[:n], st["exp_avg"][:n], st["exp_avg_sq"][:n], step=step,
                   lr=lr * hp.get("lr_scale", 1.0), beta1=betas[0], beta2=betas[1], eps=eps,
                   weight_decay=hp.get("weight_decay", 0.0))
            self.meter.drop((ADAMW_TEMPORARIES + 1) * held)
            del g32
            self._downcast(slot, st["master"])
        if self.stage < 3:
            self._gather(lambda slot: slot.grad, [k.params for k in self.kinds])
        return grad_norm, False

    def _states(self):
        """(slot, {"master", "exp_avg", "exp_avg_sq": fp32 shard}) in plan order: the tensors
        themselves, or swap files' contents in host buffers that are written back."""
        if self.optim_swap is not None:
            yield from self.optim_swap.stepping(self.slots)
            return
        for slot in self.slots:
            yield slot, {"master": slot.master, "exp_avg": slot.exp_avg,
                         "exp_avg_sq": slot.exp_avg_sq}

    def _downcast(self, slot: Slot, master: torch.Tensor) -> None:
        """The updated master into the compute dtype: at stage 3 the param shard (memory or
        swap file), else the grad partition's storage (the all-gather's source)."""
        if self.stage == 3 and self.param_swap is not None:
            self.param_swap.put(slot, {"param": master})
            return
        target = slot.param if self.stage == 3 else slot.grad
        if target is not master:
            target[:master.numel()].copy_(master)

    def param_shard(self, slot: Slot) -> torch.Tensor:
        """Stage 3: ``slot``'s param shard on the compute device (read from its swap file, or
        copied from the host, when offloaded), the source of its all-gather."""
        if self.param_swap is not None:
            return self.param_swap.load(slot)["param"].to(self._device)
        return slot.param.to(self._device)

    def _upcast(self, slot: Slot) -> torch.Tensor:
        g32 = slot.grad.float() if slot.grad.dtype != torch.float32 else slot.grad.clone()
        self.meter.hold(nbytes(g32))
        return g32

    def _square_sum(self, upcast: list[torch.Tensor] | None) -> tuple[float, bool]:
        """Global sum of squared (scaled) grads and a non-finite flag, one all-reduce."""
        acc = torch.zeros(2, dtype=torch.float64, device=self._device)
        for i, slot in enumerate(self.slots):
            g32 = upcast[i] if upcast is not None else self._upcast(slot)
            sq = g32.square()
            self.meter.hold(nbytes(sq))
            acc[0] += sq.sum(dtype=torch.float64)
            acc[1] += torch.isfinite(g32).logical_not_().sum()
            self.meter.drop(nbytes(sq) + (0 if upcast is not None else nbytes(g32)))
        if self.topology.distributed:
            dist.all_reduce(acc)
        return acc[0].item(), acc[1].item() > 0

    def _gather(self, shard_of, dest: list[torch.Tensor]) -> None:
        """All-gather every group's shard (``shard_of(slot)``) into the flat buffers ``dest``.

        One collective per group, straight into the buffer when the group has no padding (no
        temporary: the bound is the group, not a bucket); otherwise through a padded copy.
        """
        pending = []
        for k, kind in enumerate(self.kinds):
            for slot in kind.slots:
                region = dest[k][slot.offset:slot.offset + slot.numel]
                if kind.dp_size == 1:
                    region.copy_(shard_of(slot)[:slot.numel])
                elif slot.group.partition.padded_numel == slot.numel:
                    pending.append(_all_gather(region, shard_of(slot), group=kind.group,
                                               async_op=True))
                else:
                    recv = region.new_empty(slot.group.partition.padded_numel)
                    self.meter.hold(nbytes(recv))
                    _all_gather(recv, shard_of(slot), group=kind.group)
                    region.copy_(recv[:slot.numel])
                    self.meter.drop(nbytes(recv))
        for work in pending:
            work.wait()

    # ------------------------------------------------------------------ inspection
    def full_gradients(self) -> dict[str, torch.Tensor]:
        """The reduced gradients by FQN, all-gathered (collective; after ``reduce_gradients``)."""
        return self._full(lambda slot: slot.grad)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """The parameters by FQN: the params themselves at stages 1-2; at stage 3 copies
        all-gathered from the shards (collective)."""
        if self.stage < 3:
            return dict(self.params)
        return self._full(self.param_shard)

    def _full(self, shard_of) -> dict[str, torch.Tensor]:
        p0 = next(iter(self.params.values()))
        flats = [torch.empty(sum(s.numel for s in k.slots), dtype=p0.dtype, device=p0.device)
                 for k in self.kinds]
        self._gather(shard_of, flats)
        return {fqn: flats[k][pos:pos + p.numel()].view(p.shape)
                for fqn, p in self.params.items() for k, pos in [self._where[fqn]]}

    def state_pieces(self):
        """(Slice of a param, {"master", "exp_avg", "exp_avg_sq": views}) for every element
        range this rank owns, in plan order (padding omitted)."""
        for slot, st in self.shards_in_memory():
            for piece, at in slot.group.partition.rank_slices(slot.dp_rank):
                yield piece, {name: t[at:at + piece.numel] for name, t in st.items()}

    def shards(self, slots=None):
        """(partition, dp_rank, {"master", "exp_avg", "exp_avg_sq": padded fp32 shard}) for
        every local group (or ``slots``) in plan order: the tensors themselves, for checkpoints;
        with NVMe offload host buffers whose contents are written back to the swap files."""
        for slot, st in self.shards_in_memory(write_back=True, slots=slots):
            yield slot.group.partition, slot.dp_rank, st

    def shards_in_memory(self, *, write_back: bool = False, slots=None):
        """(slot, its fp32 states) one group at a time; swapped states are read into host
        buffers (and written back after the caller's turn with ``write_back``)."""
        if self.optim_swap is None:
            wanted = None if slots is None else set(slots)
            for slot, st in self._states():
                if wanted is None or slot in wanted:
                    yield slot, st
            return
        for slot in self.slots if slots is None else slots:
            bufs = self.optim_swap.load(slot)
            yield slot, bufs
            if write_back:
                self.optim_swap.store(slot, bufs)
            self.optim_swap.drop(bufs)

    def params_from_master(self) -> None:
        """Downcast every master shard and all-gather the params (collective), as the end
        of ``step`` does; after loading a checkpoint into the shards."""
        for slot, st in self.shards_in_memory():
            self._downcast(slot, st["master"])
        if self.stage < 3:
            self._gather(lambda slot: slot.grad, [k.params for k in self.kinds])

    def layout(self) -> list[dict]:
        """What is stepped, per local group in plan order: members, shard range, state sizes
        (of the plan's shard; an fp32 master that is the params' range holds its real
        elements only)."""
        rows = []
        for kind in self.kinds:
            for slot in kind.slots:
                part = slot.group.partition
                rows.append({
                    "index": slot.group.plan.index, "name": slot.group.name, "kind": kind.name,
                    "offset": slot.offset,
                    "members": [(m.fqn, m.start, m.stop) for m in slot.group.members],
                    "dp_rank": slot.dp_rank, "range": part.rank_range(slot.dp_rank),
                    "ranks": list(part.ranks), "master": slot.shard,
                    "exp_avg": slot.shard, "exp_avg_sq": slot.shard,
                    "grad": slot.grad.numel()})
        return sorted(rows, key=lambda r: r["index"])
