"""ZeRO stages 1 and 2: flat parameter buffers, sharded fp32 state and the tiled step.

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
master, exp_avg and exp_avg_sq, and the reduced gradient in the compute dtype. Stage 1 also
keeps the full local gradients in one flat buffer per kind that ``param.grad`` views (autograd
accumulates micro-batches into it in place) and takes its partition from the reduction;
stage 2 keeps only the partition and frees each ``param.grad`` as soon as it has been sent.

**Reduction.** Seen as a [dp_size, shard_numel] matrix (row d = DP rank d's shard), a group
can be reduce-scattered by column ranges. A bucket is a list of column ranges of groups of one
kind (at most ``reduce_bucket_size`` elements); its send buffer is [dp_size, cols] in fp32 and
one ``reduce_scatter_single`` (sum) gives every rank its columns, which are divided by W
(DESIGN.md §2: dense grads averaged over W; expert grads summed over the EDP group and divided
by W, i.e. the gradient of the global mean loss) and downcast into the grad partition. Sums are
taken in fp32 (one rounding for bf16/fp16 grads, as stage 0 does; on CPU the extra bandwidth
is not the bottleneck). With ``overlap_comm``, a ``register_post_accumulate_grad_hook`` on
every parameter counts ready params during the *last* micro-batch's backward (earlier ones
only accumulate locally) and launches a bucket asynchronously once all its params are ready,
strictly in a fixed order per process group (groups by the registration order of their first
param, reversed: roughly when backward finishes them), so every rank issues its collectives
in the same order. A helper thread waits for them and stores the results, freeing each send
buffer early; the hooks never block. ``reduce_gradients`` launches the rest (a missing
gradient counts as zero) and waits. A bucket's readiness needs its columns in every row, so
overlap is per group: cap groups (``max_group_size``) to overlap a large model well.

**Step** (``step``): the global grad norm is one all-reduce of local sums of squares over the
partitions, which count each element exactly once, and of a non-finite count (fp16 overflow:
every rank skips). Then, group by group (``tiled``): upcast the grad partition to fp32 ->
unscale -> x clip coefficient -> AdamW on the master (``optim.adamw_``) -> downcast into the
grad partition's storage, so only one group's fp32 gradients are alive. The untiled step
upcasts every group first and runs the same per-group ops, hence bit-identical results.
Finally the updated params are all-gathered (``all_gather_single``) group by group,
straight into the flat buffers (a padded group goes through one temporary of its size).

``MemoryMeter`` counts the engine's own bytes during the step: persistent partitions and
temporaries while they are alive. Reference counterpart: ``reference/plan/partition.py``.
"""

from __future__ import annotations

import bisect
import math
import queue
import threading
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from torch_impl.gather import ParamGatherer
from torch_impl.grouping import LocalGroup, OptimizerGroups
from torch_impl.optim import adamw_, clip_coef
from torch_impl.parallel import Topology

# torch 2.13 renamed the tensor forms; older versions only have the *_tensor names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
ADAMW_TEMPORARIES = 2  # optim.adamw_ allocates m_hat and denom, each the size of its input


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class MemoryMeter:
    """Bytes of the engine's own buffers: persistent ones plus temporaries while alive."""

    def __init__(self) -> None:
        self.persistent = self.current = self.peak = 0

    def add_persistent(self, *tensors: torch.Tensor) -> None:
        self.persistent += sum(nbytes(t) for t in tensors)
        self.peak = max(self.peak, self.persistent + self.current)

    def start(self) -> None:
        """Begin measuring one step."""
        self.current, self.peak = 0, self.persistent

    def hold(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.persistent + self.current)

    def drop(self, nbytes: int) -> None:
        self.current -= nbytes


@dataclass(eq=False)
class _Slot:
    """One local optimizer group: its place in its kind's flat buffer and this rank's shard."""

    group: LocalGroup
    offset: int  # element offset of the group in its kind's flat buffer
    dp_rank: int
    starts: list[int] = field(default_factory=list)  # member offsets (for bisect)
    master: torch.Tensor | None = None
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None
    grad: torch.Tensor | None = None  # reduced grad partition, compute dtype
    param: torch.Tensor | None = None  # stage 3: the param shard, compute dtype
    channel: str = ""  # its data-parallel group's name (``_Kind.channel``)

    @property
    def numel(self) -> int:
        return self.group.partition.numel

    @property
    def shard(self) -> int:
        return self.group.partition.shard_numel

    def rows(self, a: int, b: int):
        """(row d, lo, hi): the group elements of columns [a, b) in DP rank d's shard."""
        for d in range(self.group.partition.dp_size):
            lo, hi = d * self.shard + a, min(d * self.shard + b, self.numel)
            if lo < hi:
                yield d, lo, hi

    def members_in(self, lo: int, hi: int):
        """(fqn, param element start, start in [lo, hi), count) of members overlapping it."""
        offsets = self.group.partition.offsets
        i = max(bisect.bisect_right(self.starts, lo) - 1, 0)
        while i < len(offsets) and offsets[i][1] < hi:
            member, off = offsets[i]
            start, stop = max(lo, off), min(hi, off + member.numel)
            if start < stop:
                yield member.fqn, member.start + start - off, start - lo, stop - start
            i += 1


@dataclass(eq=False)
class _Kind:
    """A flat buffer of groups sharing one data-parallel group (dense, or moe group x EP rank)."""

    name: str
    dp_size: int
    group: object  # process group; None = the world (dense) or no communication (dp_size 1)
    channel: str  # the process group's name, to order collectives
    slots: list[_Slot]
    params: torch.Tensor | None = None
    grads: torch.Tensor | None = None  # stage 1: full local grads, viewed by param.grad


@dataclass(frozen=True)
class _Bucket:
    kind: int
    pieces: tuple[tuple[int, int, int], ...]  # (slot index in kind, column start, column stop)
    fqns: tuple[str, ...]  # params it reads

    @property
    def cols(self) -> int:
        return sum(b - a for _, a, b in self.pieces)


class _Waiter:
    """Waits for launched reduce-scatters on a helper thread and stores each result, so its
    fp32 send buffer is freed once the collective is done, while the hooks never block (a
    blocking wait inside backward could deadlock against a peer's expert all-to-all).
    The thread lives for one reduction: the first ``put`` starts it, ``join`` ends it."""

    def __init__(self, store) -> None:
        self._store, self._queue, self._thread, self._error = store, None, None, None

    def put(self, entry: tuple) -> None:
        if self._thread is None:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._run, name="moezero-reduce", daemon=True)
            self._thread.start()
        self._queue.put(entry)

    def _run(self) -> None:
        while True:
            entry = self._queue.get()
            if entry is None:
                return
            try:
                if self._error is None:
                    self._store(*entry)
            except BaseException as exc:  # re-raised on the training thread by join()
                self._error = exc
            del entry  # free the send buffer now, not at the next put

    def join(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = self._queue = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


class ZeroOptimizer:
    """Sharded optimizer state, gradient reduction and the (tiled) step for stages 1 and 2."""

    def __init__(self, params: dict[str, nn.Parameter], groups: OptimizerGroups,
                 topology: Topology, *, stage: int, bucket_size: int, overlap: bool,
                 model: nn.Module | None = None, prefetch: bool = True):
        if stage not in (1, 2, 3):
            raise ValueError(f"zero_optimization.stage: ZeroOptimizer runs 1-3, got {stage}")
        if stage == 3 and model is None:
            raise ValueError("stage 3 needs the model (its modules are the gather units)")
        self.params, self.topology, self.stage = params, topology, stage
        self.meter = MemoryMeter()
        self.kinds = self._build_kinds(groups.local)
        self.slots = [s for kind in self.kinds for s in kind.slots]
        self.slots.sort(key=lambda s: s.group.plan.index)  # plan order, for the step
        self._where: dict[str, tuple[int, int]] = {}  # fqn -> (kind, flat position)
        for k, kind in enumerate(self.kinds):
            self._place_params(k, kind)
        if set(self._where) != set(params):
            missing = sorted(set(params) - set(self._where))[:3]
            raise AssertionError(f"params outside this rank's optimizer groups: {missing}")
        if stage == 1:
            self._attach_grad_views()
        self._init_state()
        self.buckets = self._plan_buckets(bucket_size)
        self._order: dict[str, list[int]] = defaultdict(list)
        self._buckets_of: dict[str, list[int]] = defaultdict(list)
        for i, bucket in enumerate(self.buckets):
            self._order[self.kinds[bucket.kind].channel].append(i)
            for fqn in bucket.fqns:
                self._buckets_of[fqn].append(i)
        self._final = False
        self._waiter = _Waiter(self._store)
        self._reset_reduction()
        if overlap:
            for fqn, p in params.items():
                p.register_post_accumulate_grad_hook(lambda _p, fqn=fqn: self._on_grad(fqn))
        self.gatherer = None
        if stage == 3:
            self.gatherer = ParamGatherer(self, model, topology, prefetch=prefetch)

    # ------------------------------------------------------------------ construction
    def _build_kinds(self, local: tuple[LocalGroup, ...]) -> list[_Kind]:
        topo, kinds, cursor = self.topology, {}, defaultdict(int)
        for g in local:
            plan, part = g.plan, g.partition
            name = "dense" if not plan.is_expert else f"moe/{plan.moe_group}/ep{plan.ep_rank}"
            if name not in kinds:
                group = topo.edp_group(plan.ep_size) if plan.is_expert else None
                channel = f"edp{plan.ep_size}" if plan.is_expert else "world"
                kinds[name] = _Kind(name, part.dp_size, group, channel, [])
            slot = _Slot(g, cursor[name], part.dp_rank(topo.rank),
                         [off for _, off in part.offsets], channel=kinds[name].channel)
            kinds[name].slots.append(slot)
            cursor[name] += part.numel
        return list(kinds.values())

    def _place_params(self, k: int, kind: _Kind) -> None:
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
        """fp32 master (this rank's shard of the params, zero padding) and zero moments; at
        stage 3 also the compute-dtype param shard (the master itself in fp32)."""
        dtype = next(iter(self.params.values())).dtype
        for slot in self.slots:
            slot.master = torch.zeros(slot.shard, dtype=torch.float32, device=self._device)
            lo = slot.dp_rank * slot.shard
            hi = min(lo + slot.shard, slot.numel)
            if lo < hi:
                self._read_members(slot, lo, hi, slot.master, lambda fqn: self.params[fqn].data)
            slot.exp_avg, slot.exp_avg_sq = torch.zeros_like(slot.master), torch.zeros_like(slot.master)
            slot.grad = torch.zeros(slot.shard, dtype=dtype, device=self._device)
            self.meter.add_persistent(slot.master, slot.exp_avg, slot.exp_avg_sq, slot.grad)
            if self.stage == 3:
                slot.param = slot.master if dtype == torch.float32 else slot.master.to(dtype)
                if slot.param is not slot.master:
                    self.meter.add_persistent(slot.param)

    def _plan_buckets(self, cap: int) -> list[_Bucket]:
        """Column ranges of groups, <= cap elements each, in the order backward is expected to
        complete the groups: by the registration (~forward) order of their first param, last
        first. Every rank of a data-parallel group computes the same order."""
        position = {fqn: i for i, fqn in enumerate(self.params)}
        buckets = []
        for k, kind in enumerate(self.kinds):
            cols_cap, pieces, cols = max(1, cap // kind.dp_size), [], 0
            first_use = [min(position[m.fqn] for m in s.group.members) for s in kind.slots]
            for si in sorted(range(len(kind.slots)), key=lambda i: -first_use[i]):
                a, shard = 0, kind.slots[si].shard
                while a < shard:
                    b = min(shard, a + cols_cap - cols)
                    pieces.append((si, a, b))
                    cols, a = cols + b - a, b
                    if cols == cols_cap:
                        buckets.append(self._bucket(k, pieces))
                        pieces, cols = [], 0
            if pieces:
                buckets.append(self._bucket(k, pieces))
        return buckets

    def _bucket(self, k: int, pieces: list) -> _Bucket:
        fqns = {}
        for si, a, b in pieces:
            slot = self.kinds[k].slots[si]
            for _, lo, hi in slot.rows(a, b):
                fqns.update((fqn, None) for fqn, *_ in slot.members_in(lo, hi))
        return _Bucket(k, tuple(pieces), tuple(fqns))

    # ------------------------------------------------------------------ gradients
    def before_backward(self, *, final: bool) -> None:
        """Called before each micro-batch's backward; ``final`` = the step's last one."""
        self._final = final
        if self.stage == 1:
            self._attach_grad_views()

    def after_backward(self) -> None:
        """Called after each micro-batch's backward: stage 3 releases what it still holds."""
        if self.gatherer is not None:
            self.gatherer.after_backward()

    def close(self) -> None:
        """Drop gathers in flight and release offload resources (idempotent)."""
        if self.gatherer is not None:
            self.gatherer.drain()

    def _attach_grad_views(self) -> None:
        for fqn, p in self.params.items():
            if p.grad is None:
                k, pos = self._where[fqn]
                p.grad = self.kinds[k].grads[pos:pos + p.numel()].view_as(p)

    def _on_grad(self, fqn: str) -> None:
        if not self._final:
            return
        for i in self._buckets_of[fqn]:
            self._waiting[i] -= 1
        self._launch_ready(flush=False)

    def _launch_ready(self, *, flush: bool) -> None:
        for channel, order in self._order.items():
            i = self._next[channel]
            while i < len(order) and (flush or self._waiting[order[i]] == 0):
                self._launch(order[i])
                i += 1
            self._next[channel] = i

    def _launch(self, index: int) -> None:
        bucket = self.buckets[index]
        kind = self.kinds[bucket.kind]
        send = torch.zeros(kind.dp_size, bucket.cols, dtype=torch.float32, device=self._device)
        col = 0
        for si, a, b in bucket.pieces:
            slot = kind.slots[si]
            for d, lo, hi in slot.rows(a, b):
                self._read_grads(kind, slot, lo, hi, send[d, col:col + hi - lo])
            col += b - a
        if kind.dp_size == 1:
            out, work = send[0], None
        else:
            out = torch.empty(bucket.cols, dtype=torch.float32, device=self._device)
            work = _reduce_scatter(out, send.view(-1), group=kind.group, async_op=True)
        if work is None:
            self._store(index, out, work)
        else:
            self._waiter.put((index, out, work, send))  # send stays alive until the op is done
        if self.stage >= 2:
            self._release(bucket)

    def _read_grads(self, kind: _Kind, slot: _Slot, lo: int, hi: int, dst: torch.Tensor) -> None:
        """Copy (upcasting) the group elements [lo, hi) of the local gradients into ``dst``."""
        if kind.grads is not None:
            dst.copy_(kind.grads[slot.offset + lo:slot.offset + hi])
            return
        # no gradient (e.g. an expert that saw no token) is zero
        self._read_members(slot, lo, hi, dst, lambda fqn: self.params[fqn].grad)

    @staticmethod
    def _read_members(slot: _Slot, lo: int, hi: int, dst: torch.Tensor, tensor_of) -> None:
        """Copy the group elements [lo, hi) of ``tensor_of(fqn)`` (None: skipped) into ``dst``."""
        for fqn, start, at, count in slot.members_in(lo, hi):
            t = tensor_of(fqn)
            if t is not None:
                dst[at:at + count].copy_(t.reshape(-1)[start:start + count])

    def _release(self, bucket: _Bucket) -> None:
        for fqn in bucket.fqns:
            self._unsent[fqn] -= 1
            if self._unsent[fqn] == 0:
                self.params[fqn].grad = None

    def reduce_gradients(self) -> None:
        """Launch every bucket not yet launched, wait, and store (sum / W) in the partitions."""
        self._launch_ready(flush=True)
        self._waiter.join()
        self._reset_reduction()

    def _store(self, index: int, out: torch.Tensor, work, _send=None) -> None:
        """Wait for a bucket's reduce-scatter; put (sum / W) into the grad partitions."""
        if work is not None:
            work.wait()
        out.div_(self.topology.world_size)
        bucket, col = self.buckets[index], 0
        for si, a, b in bucket.pieces:
            self.kinds[bucket.kind].slots[si].grad[a:b].copy_(out[col:col + b - a])
            col += b - a

    def _reset_reduction(self) -> None:
        self._final = False
        self._waiting = [len(b.fqns) for b in self.buckets]
        self._next = dict.fromkeys(self._order, 0)
        self._unsent = defaultdict(int)
        for bucket in self.buckets:
            for fqn in bucket.fqns:
                self._unsent[fqn] += 1

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
        for i, slot in enumerate(self.slots):
            g32 = upcast[i] if upcast is not None else self._upcast(slot)
            if upcast is not None:
                upcast[i] = None
            g32.mul_(1.0 / scale).mul_(clip)
            hp = slot.group.hparams
            self.meter.hold(ADAMW_TEMPORARIES * nbytes(g32))
            adamw_(slot.master, g32, slot.exp_avg, slot.exp_avg_sq, step=step,
                   lr=lr * hp.get("lr_scale", 1.0), beta1=betas[0], beta2=betas[1], eps=eps,
                   weight_decay=hp.get("weight_decay", 0.0))
            self.meter.drop((ADAMW_TEMPORARIES + 1) * nbytes(g32))
            del g32
            self._downcast(slot)
        if self.stage < 3:
            self._gather(lambda slot: slot.grad, [k.params for k in self.kinds])
        return grad_norm, False

    def _downcast(self, slot: _Slot) -> None:
        """The updated master into the compute dtype: at stage 3 the param shard, else the
        grad partition's storage (the all-gather's source)."""
        target = slot.param if self.stage == 3 else slot.grad
        if target is not slot.master:
            target.copy_(slot.master)

    def _upcast(self, slot: _Slot) -> torch.Tensor:
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
        return self._full(lambda slot: slot.param)

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
        for slot in self.slots:
            for piece, at in slot.group.partition.rank_slices(slot.dp_rank):
                views = {name: getattr(slot, name)[at:at + piece.numel]
                         for name in ("master", "exp_avg", "exp_avg_sq")}
                yield piece, views

    def shards(self):
        """(partition, dp_rank, {"master", "exp_avg", "exp_avg_sq": padded fp32 shard}) for
        every local group in plan order: the tensors themselves, for checkpoints."""
        for slot in self.slots:
            yield slot.group.partition, slot.dp_rank, {
                name: getattr(slot, name) for name in ("master", "exp_avg", "exp_avg_sq")}

    def params_from_master(self) -> None:
        """Downcast every master shard and all-gather the params (collective), as the end
        of ``step`` does; after loading a checkpoint into the shards."""
        for slot in self.slots:
            self._downcast(slot)
        if self.stage < 3:
            self._gather(lambda slot: slot.grad, [k.params for k in self.kinds])

    def layout(self) -> list[dict]:
        """What is stepped, per local group in plan order: members, shard range, state sizes."""
        rows = []
        for kind in self.kinds:
            for slot in kind.slots:
                part = slot.group.partition
                rows.append({
                    "index": slot.group.plan.index, "name": slot.group.name, "kind": kind.name,
                    "offset": slot.offset,
                    "members": [(m.fqn, m.start, m.stop) for m in slot.group.members],
                    "dp_rank": slot.dp_rank, "range": part.rank_range(slot.dp_rank),
                    "ranks": list(part.ranks), "master": slot.master.numel(),
                    "exp_avg": slot.exp_avg.numel(), "exp_avg_sq": slot.exp_avg_sq.numel(),
                    "grad": slot.grad.numel()})
        return sorted(rows, key=lambda r: r["index"])
