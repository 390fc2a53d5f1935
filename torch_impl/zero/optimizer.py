"""The optimizer interface of every ZeRO stage and the step all stages share.

``Optimizer`` is what the engine holds: ``moezero.zero.replicated.ReplicatedOptimizer`` (stage
0: every rank keeps the whole state of its groups) or ``moezero.zero.sharded.ShardedOptimizer``
(stages 1-3: each rank keeps a shard). Both are built on the same pieces: flat buffers by kind
(``moezero.zero.flat``), one ``Slot`` per local optimizer group in plan order, the bucketed
gradient reduction (``moezero.zero.reduce``) and the step below. The engine calls, per training
step: ``before_backward`` / ``after_backward`` around each micro-batch's backward,
``reduce_gradients``, ``step``, ``zero_grad``. A checkpoint receives ``shards()`` (what this rank
saves) and ``load_targets()`` (what it fills on load, then ``after_load``); it never sees the
optimizer itself. The optimizer owns the objects those come from, each given what it needs at
construction: its swap files (``zero.swaps.Swaps``), the fp32 states (``zero.states``), the
frozen weights (``zero.frozen``) and the view checkpoints see (``zero.state_view``).

**Step.** The global grad norm is one all-reduce of local sums of squares over each rank's
*own* range of every group (its shard: each element is counted exactly once, on every stage,
so stage 0's norm equals the sharded stages' bit for bit) and of a non-finite count (fp16
overflow: every rank skips). Then, group by group (``tiled``), one pass of
``hostadam.adamw_step_`` per group: upcast the gradient to fp32, x (unscale x clip
coefficient), AdamW on the fp32 master and, where the compute-dtype target is in host memory,
the downcast, each element read and written once. The untiled step upcasts every group first
and runs the same per-group pass, hence bit-identical results. The offloaded tiers
(``host_step``) run the same pass window by window (``buckets.plan_windows``): a window's
gradients, in the compute dtype, are copied to the host (``transfer.HostTransfer``: pinned, on
a side stream) while the previous window steps there, swap reads run a window ahead
(``offload.state.SwapState.stepping``, ``zero.gradtier``), and the masters travel back. Every
tier and stage runs the same kernel on the same elements, so they are bit-identical to each
other. Reference: ``reference/zero.py`` (the sharded step), ``reference/optim.py``. **Frozen groups**
(``train.freeze``) are slots too (``frozen``): held and gathered like the others, never
stepped, no gradient or fp32 state; checkpoints get their weights (``zero.frozen``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from moezero.distributed.topology import Topology
from moezero.plan.partition import Partition
from moezero.plan.state_shard import StateShard
from moezero.zero.adamw import clip_coef
from moezero.zero.behind import StepBehind
from moezero.zero.buckets import GroupColumns, plan_windows
from moezero.zero.flat import attach_grad_views, build_kinds, flatten_params, param_positions
from moezero.zero.frozen import FrozenWeights
from moezero.zero.gradtier import square_sum
from moezero.zero.groups import OptimizerGroups
from moezero.zero.hostadam import adamw_step_, load_compiled
from moezero.zero.options import ZeroOptions
from moezero.zero.reduce import GradReduction
from moezero.zero.shards import MemoryMeter, Slot, nbytes
from moezero.zero.state_view import StateView
from moezero.zero.states import OptimizerStates
from moezero.zero.swaps import Swaps
from moezero.zero.transfer import HostTransfer, Staged

ADAMW_TEMPORARIES = 0  # adamw_step_ allocates nothing per element (its torch-ops fallback: a
# few chunks of ``hostadam.CHUNK`` elements)


class Optimizer:
    """Gradient reduction, fp32 state and the (tiled) step of the local optimizer groups.

    The stage's optimizer (``ReplicatedOptimizer``, ``ShardedOptimizer``) builds the slots'
    state and implements the per-stage methods at the end of this class: where this rank's
    range of a slot lies (``_local``), which ranges it loads (``_load_ranges``), where the
    updated master goes (``_downcast``) and what ends a step (``_after_step``). It owns its
    swap files (``swaps``), and from ``_build_views``, the fp32 states (``states``), the
    frozen weights (``frozen_weights``) and the checkpoints' view of both (``view``).
    """

    clone_fp32_grads = True  # the step's fp32 gradient is a copy, not ``Slot.grad`` itself

    def __init__(self, params: dict[str, nn.Parameter], topology: Topology,
                 options: ZeroOptions) -> None:
        self.params, self.topology = params, topology
        if options.host_step or self._device.type != "cuda":
            # Built (first use on a machine: about a minute) or loaded here, where every rank
            # is at the same point, not inside a step that others wait on in a collective.
            load_compiled()
        self.meter = MemoryMeter()
        self.swaps = Swaps()  # NVMe: the swap files of each tier (set by a stage's optimizer)
        self.grad_tier = None  # NVMe at stage 3: the reduced gradients' tier (``zero.gradtier``)
        self.state_device = self._device
        self.full_grads = False
        self.transfer = HostTransfer(self._device)
        self.host_windows: tuple[tuple[Slot, ...], ...] | None = None  # the offloaded step's
        self.behind: StepBehind | None = None  # ``step_in_forward`` (set by a subclass)

    def _build_buffers(self, groups: OptimizerGroups, columns: Callable[[Partition], GroupColumns],
                       *, flat: bool, full_grads: bool) -> None:
        """Kinds and slots (plan order); with ``flat`` the params become views of one flat
        buffer per kind, with ``full_grads`` their gradients too."""
        self.kinds = build_kinds(groups.local, self.topology, columns)
        ordered = sorted((s for kind in self.kinds for s in kind.slots),
                         key=lambda s: s.group.plan.index)
        self.slots = [s for s in ordered if not s.group.plan.frozen]
        self.frozen = [s for s in ordered if s.group.plan.frozen]
        frozen = {m.fqn for s in self.frozen for m in s.group.members}
        for fqn in frozen:
            self.params[fqn].requires_grad_(False)
        self.trained = {f: p for f, p in self.params.items() if f not in frozen}
        self.where = param_positions(self.kinds, self.params)
        self.full_grads = full_grads
        if flat:
            flatten_params(self.kinds, self.params, self.where, full_grads=full_grads,
                           meter=self.meter)
        if full_grads:
            attach_grad_views(self.trained, self.kinds, self.where)

    def _build_views(self, frozen: FrozenWeights) -> None:
        """Once the slots and ``swaps`` are built: the trained groups' fp32 states, the
        frozen groups' weights (``frozen``) and the view checkpoints get of both."""
        self.states = OptimizerStates(self.slots, self.swaps.optim)
        self.frozen_weights = frozen
        self.view = StateView(self.states, frozen, local=self._local,
                              load_ranges=self._load_ranges, finish=self.finish_step)

    @property
    def optim_swap(self):
        """NVMe: the fp32 states' swap files (``offload.state.SwapState``), or None."""
        return self.swaps.optim

    @property
    def param_swap(self):
        """NVMe at stage 3: the param shards' swap files, or None."""
        return self.swaps.param

    def _plan_host_step(self, options: ZeroOptions, order: list[Slot] | None = None) -> None:
        """With ``options.host_step``: the windows of the offloaded step over ``order``'s
        slots (default: plan order; any order, the same numbers)."""
        order = order or self.slots
        if options.host_step:
            self.host_windows = tuple(
                tuple(order[i] for i in w)
                for w in plan_windows([s.shard for s in order], options.host_window))

    def _build_reduction(self, options: ZeroOptions, *, all_reduce: bool, release: bool) -> None:
        self.reduction = GradReduction(self.trained, [k for k in self.kinds if not k.frozen],
                                       bucket_size=options.reduce_bucket_size,
                                       overlap=options.overlap_comm, all_reduce=all_reduce,
                                       release=release, world_size=self.topology.world_size,
                                       dtype=options.reduce_dtype, tier=self.grad_tier)

    @property
    def _device(self) -> torch.device:
        return next(iter(self.params.values())).device

    # ------------------------------------------------------------------ gradients
    def before_backward(self, *, final: bool) -> None:
        """Called before each micro-batch's backward; ``final`` = the step's last one."""
        self.finish_step()
        self.reduction.before_backward(final=final)
        if self.full_grads:
            attach_grad_views(self.trained, self.kinds, self.where)

    def after_backward(self) -> None:
        """Called after each micro-batch's backward."""

    def reduce_gradients(self) -> None:
        """Launch every gradient bucket not yet launched, wait, store the sums / W."""
        self.reduction.reduce_gradients()
        if self.grad_tier is not None:
            self.grad_tier.finish()

    def zero_grad(self) -> None:
        """After a step: clear the local gradients (full gradient buffers keep their views)."""
        for kind in self.kinds:
            if kind.grads is not None:
                kind.grads.zero_()
        if not self.full_grads:
            for p in self.params.values():
                p.grad = None

    # ------------------------------------------------------------------ step
    def step(self, *, lr: float, scale: float, max_norm: float | None, step: int,
             betas: tuple[float, float], eps: float, tiled: bool) -> tuple[float, bool]:
        """Clip and AdamW-step every group on the reduced gradients.

        Returns (grad norm of the unscaled gradients, overflow); on overflow nothing changes.
        """
        self.finish_step()
        self.meter.start()
        upcast = None if tiled else [self._upcast(s) for s in self.slots]
        sq, overflow = self._square_sum(upcast)
        if overflow:
            for _, held in upcast or ():
                self.meter.drop(held)
            return float("inf"), True
        grad_norm = math.sqrt(sq) / scale
        grad_mul = clip_coef(grad_norm, max_norm) / scale  # applied inside the AdamW pass
        adam = {"step": step, "beta1": betas[0], "beta2": betas[1], "eps": eps}
        if self.behind is not None:  # zero.behind (only with host_windows)
            self.behind.start(self.slots, partial(self._step_host, upcast, grad_mul, lr, adam))
            return grad_norm, False
        if self.host_windows is not None:
            self._step_host(upcast, grad_mul, lr, adam)
        else:
            self._step_groups(upcast, grad_mul, lr, adam)
        self._after_step()
        return grad_norm, False

    def _step_groups(self, upcast: list | None, grad_mul: float, lr: float, adam: dict) -> None:
        """Group by group where the state lives (the device, without offload)."""
        for i, (slot, st) in enumerate(self.states.stepping()):
            grad, held = upcast[i] if upcast is not None else self._grad(slot)
            if upcast is not None:
                upcast[i] = None
            self._adamw(slot, st, grad, held, grad_mul, lr, adam)
            del grad

    def _step_host(self, upcast: list | None, grad_mul: float, lr: float, adam: dict,
                   **hooks) -> None:
        """The offloaded step, window by window: the next window's gradients travel to the
        host (and its swapped state is read) while this one is stepped there, and its masters
        travel back; ``hooks``: ``SwapState.stepping``'s ``written`` and ``issued``."""
        index = {slot: i for i, slot in enumerate(self.slots)}
        windows = self.host_windows
        staged = self._stage(windows[0], upcast, index)
        for w, pairs in enumerate(self.states.windows(windows, **hooks)):
            ahead = (self._stage(windows[w + 1], upcast, index)
                     if w + 1 < len(windows) else None)
            (host, held), staged = staged, ahead
            for (slot, st), grad in zip(pairs, host.wait(), strict=True):
                self._adamw(slot, st, grad, 0, grad_mul, lr, adam)
            self.meter.drop(held)
            del host
        self.transfer.finish()

    def finish_step(self) -> None:
        """Wait for a step running behind the forward (``zero.behind``); raise its error."""
        if self.behind is not None:
            self.behind.finish()

    def _stage(self, window: tuple[Slot, ...], upcast: list | None,
               index: dict) -> tuple[Staged, int]:
        """The window's gradients (compute dtype, or fp32 when untiled) on their way to the
        host; and the bytes they hold (fp32 copies, swap reads, host copies)."""
        grads, held = [], 0
        for slot in window:
            i = index[slot]
            grad, h = upcast[i] if upcast is not None else self._grad(slot)
            if upcast is not None:
                upcast[i] = None
            grads.append(grad)
            held += h
        staged = self.transfer.to_host(grads)
        copies = sum(nbytes(h) for h, g in zip(staged.tensors, grads, strict=True) if h is not g)
        self.meter.hold(copies)
        return staged, held + copies

    def _adamw(self, slot: Slot, st: dict, grad: torch.Tensor, held: int, grad_mul: float,
               lr: float, adam: dict) -> None:
        """One pass of AdamW on the state's device (offload: where the state is) from ``grad``
        (any float dtype) x ``grad_mul``, writing the downcast where ``_downcast_target``
        allows (else ``_downcast`` follows); drops the ``held`` bytes of the gradient."""
        grad = grad.to(self.state_device)
        hp = slot.group.hparams
        master = st["master"]
        n = master.numel()  # the shard, or its real elements (master = params)
        out = self._downcast_target(slot, master)
        adamw_step_(master, grad[:n], st["exp_avg"][:n], st["exp_avg_sq"][:n], out=out,
                    grad_mul=grad_mul, lr=lr * hp.get("lr_scale", 1.0),
                    weight_decay=hp.get("weight_decay", 0.0), **adam)
        if out is None:
            self._downcast(slot, master)
        self.meter.drop(held)

    def _grad(self, slot: Slot) -> tuple[torch.Tensor, int]:
        """The slot's reduced gradient as it is (compute dtype, no copy; with the gradient
        tier: read from its swap file into a host buffer) and the bytes that took."""
        if self.grad_tier is not None:
            return self.grad_tier.take(slot)
        return slot.grad, 0

    def _upcast(self, slot: Slot, lo: int = 0, hi: int | None = None) -> tuple[torch.Tensor, int]:
        """Elements [lo, hi) of the slot's reduced gradient in fp32, and the bytes that took
        (with the gradient tier: the whole partition, read from its swap file)."""
        if self.grad_tier is not None:
            grad, held = self.grad_tier.take(slot)
            g32 = grad.float()  # the read buffer is a fresh copy: no clone
            if g32 is not grad:
                self.meter.drop(held)
                del grad
                held = nbytes(g32)
                self.meter.hold(held)
            return g32, held
        grad = slot.grad[lo:hi]
        g32 = grad.float()
        if g32 is grad and self.clone_fp32_grads:
            g32 = grad.clone()
        held = 0 if g32 is grad else nbytes(g32)
        self.meter.hold(held)
        return g32, held

    def _square_sum(self, upcast: list | None) -> tuple[float, bool]:
        """Global sum of squared (scaled) grads over every rank's own ranges and a non-finite
        flag, in one all-reduce over all ranks."""
        acc = torch.zeros(2, dtype=torch.float64, device=self._device)
        for i, slot in enumerate(self.slots):
            if self.grad_tier is not None and upcast is None:  # taken as the partition landed
                sq, bad = self.grad_tier.sums(slot)
                acc[0] += sq
                acc[1] += bad
                continue
            lo, hi = self._local(slot)
            # read, never written: the gradient as it is (``square_sum`` upcasts), no copy
            grad = upcast[i][0][lo:hi] if upcast is not None else slot.grad[lo:hi]
            sq, bad = square_sum(grad)
            acc[0] += sq
            acc[1] += bad
        if self.topology.distributed:
            dist.all_reduce(acc)
        return acc[0].item(), acc[1].item() > 0

    # ------------------------------------------------------------------ checkpoints
    def shards(self, *, frozen: bool = True) -> list[StateShard]:
        """What this rank saves (``StateView.shards``; ``frozen``: the frozen groups' too)."""
        return self.view.shards(frozen=frozen)

    def load_targets(self, *, trained: bool = True, frozen: bool = True) -> Iterator[StateShard]:
        """What this rank fills from a checkpoint (``StateView.load_targets``); call
        ``after_load`` once they are filled."""
        return self.view.load_targets(trained=trained, frozen=frozen)

    def state_pieces(self):
        """(Slice of a param, its fp32 states' views) for every element range this rank
        owns, in plan order (``StateView.state_pieces``)."""
        return self.view.state_pieces()

    def after_load(self) -> None:
        """Derive the compute-dtype params from the loaded masters (collective)."""
        self.params_from_master()

    def params_from_master(self) -> None:
        """Downcast every master and finish as a step does (collective at stages 1-2)."""
        self.finish_step()
        for slot, st in self.states.read():
            self._downcast(slot, st["master"])
        self._after_step()

    def swap_traffic(self) -> dict[str, int]:
        """Bytes read from / written to this rank's swap files so far and seconds blocked on
        them, by tier (``optim_``, ``param_``, ``grad_`` + ``read``/``write``/``wait_s``)."""
        return self.swaps.traffic()

    def close(self) -> None:
        """Release what the optimizer holds beyond memory (a clean exit)."""

    # ------------------------------------------------------------------ per stage
    def _local(self, slot: Slot) -> tuple[int, int]:
        """[lo, hi) of this rank's own range within the slot's gradient and state tensors."""
        raise NotImplementedError

    def _load_ranges(self, slot: Slot) -> list[tuple[int, int, int]]:
        """(DP rank, lo, hi): the ranges of the slot's state tensors filled on load."""
        raise NotImplementedError

    def _downcast(self, slot: Slot, master: torch.Tensor) -> None:
        """The updated (or loaded) master into the compute-dtype params."""
        raise NotImplementedError

    def _downcast_target(self, slot: Slot, master: torch.Tensor) -> torch.Tensor | None:
        """The host tensor the AdamW pass writes the updated master into (what ``_downcast``
        would fill), or None: ``_downcast`` runs after the pass."""
        return None

    def _after_step(self) -> None:
        """What ends a step once every group is stepped (the sharded all-gather)."""

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """The reduced gradients by FQN (after ``reduce_gradients``)."""
        raise NotImplementedError

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """The parameters by FQN."""
        raise NotImplementedError

    def layout(self) -> list[dict]:
        """What is stepped, per local group in plan order (``param_groups.json``)."""
        raise NotImplementedError
