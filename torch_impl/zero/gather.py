"""ZeRO-3 parameter gathering: params live as shards; a module's params exist only while used.

**Units** (``plan_units``: pure, frozen ``GatherUnit`` records). The model's root, every module
of an ``nn.ModuleList`` (the decoder's blocks) and every ``MoE`` layer are gather units; so is
each other child of the root (the decoder's embedding, final norm and LM head:
``own_units``) whose groups no other unit needs, so it is gathered only around its own call;
one whose groups another unit needs stays in the root's unit, gathered for the whole pass
(with one dense group, the embedding would otherwise gather every dense param again for each
block). A unit
owns the params below it that no nested unit owns, split by data-parallel kind (dense params;
each moe group's experts), so the dense part of a MoE layer (its router) and its experts are
released independently. A unit needs every optimizer group holding one of its params, closed
over the groups of those groups' members (a param sliced across groups by
``moe.max_group_size`` is gathered whole). With one dense group (the default grouping) every
dense param is gathered at once; ``moe.split_dense_by_layer`` gives each block its own dense
groups, so a unit gathers its block only (a cap would not help: the chunks a cap cuts share
sliced params, and the closure chains through them).

**Inputs.** ``ParamGatherer`` receives the model (its modules carry the hooks), the params by
FQN, the optimizer's slots (each group's members and partition) and a fetch function giving a
slot's param shard on the compute device; it never calls back into the optimizer.

**Forward.** A unit's forward pre-hook gathers its groups (the groups neither resident nor in
flight, in buckets of ``allgather_bucket_size`` elements: ``moezero.zero.buckets.plan_gathers``,
so one all-gather per unit and pass rather than one per group; each bucket's receive buffer is
copied into the params' storage, re-allocated for the purpose: one per unit where its groups
allow, ``moezero.zero.group_storage``) and starts the next unit's gathers asynchronously
(prefetch); its forward hook releases them (``untyped_storage().resize_(0)``: the params keep
their shape, autograd keeps its references) and, when grad is enabled, routes the outputs
through ``UnitHook``, whose backward gathers the unit again before the unit's own backward
runs (and prefetches the unit before it). A unit is released in backward once every param it
owns has accumulated its gradient; whatever is still held (e.g. a param that got no gradient)
is released by
``after_backward``, which then checks that no group is still referenced (a pre-hook without
its hook would leave a group resident, and the next forward would read it instead of the
updated shard). Groups are reference-counted, so a group two active units share stays.

**Activation checkpointing** (``moezero.model.recompute``). A checkpointed block's forward runs
again inside its backward: the hooks of the units inside it fire again, so such a unit is
gathered for the recomputation and released after it, as in forward. While ``recomputing()``
the pre-hook does not prefetch the next unit (backward already prefetches the one before) and
the hook does not wrap the outputs in ``UnitHook`` (the recomputed graph is never
back-propagated: torch keeps only its saved tensors).

**Prefetch limit** (``zero_optimization.prefetch_max_bytes``). Only a unit whose params take
at most that many bytes is gathered ahead (a big model's MoE layer, 0.6 GB of experts a rank,
is then gathered when it runs, never beside the one before it); the same numbers, only when
the bytes arrive changes.

**Read-ahead** (NVMe params). With ``read_ahead`` > 0 the gatherer also receives a ``hint``
function and, whenever it gathers a unit, hints the groups of the next ``read_ahead`` units
that still need any (neither resident nor in flight), nearest first, in the order they will
be fetched: in forward the units after it in module order; in backward (hinted first when
the root's forward ends) this forward's post-forward calls in reverse, the order their
outputs receive gradients, each followed by the unit its pre-backward prefetches. The fetch
function's source (``offload.state.SwapState.hint``) starts their swap file reads in the
background, so the disk works while earlier units compute. Every hint replaces the last, so at most
``read_ahead`` units' shards are read ahead; ``drain`` hints nothing (after each backward,
before the step), and ``read_ahead_start`` hints the first units once a step is done.

**Kept for backward** (``keep_bytes``, ``offload_param.keep_for_backward``). Backward starts
with the units the forward ran last: with a budget, the forward's latest units stay gathered
(oldest released first while they exceed it) and backward finds them resident: no fetch, no
read from swap. The same params, so the same numbers; only the bytes moved change.

**Ordering.** gloo and NCCL need every rank of a group to issue its collectives in the same
order. The gathers run on their own copies of the world and EDP groups (``gather_groups``),
so they never interleave with gradient reduce-scatters, which depend on when gradients
arrive. Dense units are gathered and released at the same points on every rank (every rank
runs the same modules and gets the same dense gradients); expert units only hold expert
groups, which nothing else gathers.
Reference counterpart: none. The reference's sharded step (``reference/zero.py``) ends with the
all-gather; stage 3 only moves that gather to the next use, which changes no number (stage 3
is tested bit-identical to stage 2, tests/torch_impl/test_stage3.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from moezero.model.recompute import recomputing
from moezero.zero.allgather import Launched, launch
from moezero.zero.buckets import GatherBucket, plan_gathers
from moezero.zero.gather_grad import UnitHook, flatten, rebuild
from moezero.zero.gather_units import GatherUnit, own_units, param_kind, plan_units, unit_modules
from moezero.zero.group_storage import GroupStorage
from moezero.zero.shards import Slot

__all__ = ["GatherUnit", "ParamGatherer", "own_units", "param_kind", "plan_units", "unit_modules"]


@dataclass(eq=False)
class _State:
    refs: list[int]
    resident: set[int] = field(default_factory=set)
    inflight: dict[int, list[Launched]] = field(default_factory=dict)  # the buckets holding it


class ParamGatherer:
    """Gathers and releases a stage-3 model's params around each unit's forward and backward.

    Args:
        model: The model; its unit modules get the hooks.
        params: Its parameters by FQN (their storage is freed now, re-allocated while used).
        slots: The optimizer's slots (groups, partitions, channels), in plan order.
        fetch: ``fetch(slot)``: the slot's param shard on the compute device.
        groups: Process group by channel name (``distributed.topology.gather_groups``).
        prefetch: Start the next unit's gathers while a unit runs.
        prefetch_max_bytes: Only for a next unit of at most these bytes of params (None: any).
        bucket_size: ``allgather_bucket_size``, elements per all-gather (None: one per group).
        hint: ``hint(slots)``: these slots will be fetched soon, nearest first (forgetting
            earlier hints not among them); used when ``read_ahead`` > 0.
        read_ahead: Units ahead of the gathered one whose groups are hinted (0: no hints).
        keep_bytes: Gathered bytes of the forward's last units kept for backward (0: none).
    """

    def __init__(self, model: nn.Module, params: dict[str, nn.Parameter], slots: Sequence[Slot],
                 fetch: Callable[[Slot], torch.Tensor], groups: dict, *, prefetch: bool = True,
                 prefetch_max_bytes: int | None = None, bucket_size: int | None, hint: Callable[[list[Slot]], None] | None = None,
                 read_ahead: int = 0, keep_bytes: int = 0):
        self.params, self.slots, self.fetch = params, slots, fetch
        self.keep_bytes, self._kept = keep_bytes, []  # units held for backward, oldest first
        self.groups, self.bucket_size = groups, bucket_size
        self.hint, self.read_ahead = (hint, read_ahead) if hint and read_ahead > 0 else (None, 0)
        self._post: list[list[int]] = []  # read-ahead: units by post-forward since the backward
        self._plans: dict[tuple[int, ...], tuple[GatherBucket, ...]] = {}
        modules = unit_modules(model)
        self.units = plan_units([n for n, _ in modules],
                                {fqn: param_kind(p) for fqn, p in model.named_parameters()},
                                [[m.fqn for m in s.group.members] for s in slots],
                                own_units(model))
        self.state = _State([0] * len(slots))
        self.pending = [0] * len(self.units)  # backward: owned params whose grad has not arrived
        self.active = [False] * len(self.units)  # held for backward
        self.owner = {fqn: u for u, unit in enumerate(self.units) for fqn in unit.fqns}
        self.unit_bytes = [sum(params[m.fqn].nbytes for i in unit.slots
                               for m in slots[i].group.members) for unit in self.units]
        self.ahead = [prefetch and (prefetch_max_bytes is None or b <= prefetch_max_bytes)
                      for b in self.unit_bytes]  # gathered ahead of its use
        for name, module in modules:
            units = [u for u, unit in enumerate(self.units) if unit.module == name]
            module.register_forward_pre_hook(lambda m, a, units=units: self._pre_forward(units, a))
            module.register_forward_hook(lambda m, a, out, units=units, root=module is model:
                                         self._post_forward(units, out, root))
        # Backward releases a unit once its trained params' gradients arrived and, if it has
        # frozen params (no gradient to wait for), once its inputs' gradient is computed (their
        # last use: a ``UnitHook`` on its inputs); else it is held until ``after_backward``.
        self.waits = [sum(params[f].requires_grad for f in unit.fqns)
                      + any(not params[f].requires_grad for f in unit.fqns) for unit in self.units]
        self.frozen_in = [w > sum(params[f].requires_grad for f in unit.fqns)
                          for w, unit in zip(self.waits, self.units, strict=True)]
        for fqn, p in params.items():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda _p, fqn=fqn: self._on_grad(fqn))
        self.storage = GroupStorage(params, slots, [u.slots for u in self.units])  # all freed

    # ------------------------------------------------------------------ hooks
    def _pre_forward(self, units: list[int], args: tuple) -> tuple | None:
        for u in units:
            self._acquire(u)
        self._prefetch_after(units)
        if not torch.is_grad_enabled() or recomputing() or not any(self.frozen_in[u] for u in units):
            return None
        tensors = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        if not tensors:
            return None
        wrapped = iter(UnitHook.apply(partial(self._on_inputs_done, units), *tensors))
        return tuple(next(wrapped) if isinstance(a, torch.Tensor) and a.requires_grad else a
                     for a in args)

    def _prefetch_after(self, units: list[int]) -> None:
        """Start the next unit's gathers (and hint the reads ahead) as ``units`` run."""
        if not recomputing():
            after = units[-1] + 1 if units else len(self.units)
            for u in range(after, min(after + 1, len(self.units))):
                if self.ahead[u]:
                    self._start(self.units[u].slots)
        if units and not recomputing():  # a recomputed block: backward's hints stand
            self._read_ahead(range(units[-1] + 1, len(self.units)))

    def _post_forward(self, units: list[int], out, root: bool = False):
        keep = self._keep if self.keep_bytes and torch.is_grad_enabled() and not recomputing() \
            else self._release
        for u in units:
            keep(u)
        if not torch.is_grad_enabled() or recomputing():
            return out
        tensors = [t for t in flatten(out) if t.requires_grad] if units else []
        if tensors and self.hint is not None:  # read-ahead: the order backward fetches in
            self._post.append(units)
        if root and self.hint is not None:  # the forward is done: backward fetches next
            self._read_ahead(self._backward_fetches(0))
        if not tensors:
            return out
        wrapped = iter(UnitHook.apply(partial(self._pre_backward, units), *tensors))
        swap = {id(t): next(wrapped) for t in tensors}
        return rebuild(out, swap)

    def _pre_backward(self, units: list[int]) -> None:
        for u in units:
            self._acquire(u)
            self.pending[u], self.active[u] = self.waits[u], True
            if u in self._kept:  # held since its forward: now held for its backward
                self._kept.remove(u)
                self._release(u)
        if units[0] > 0 and self.ahead[units[0] - 1]:
            self._start(self.units[units[0] - 1].slots)
        if self.hint is not None and units in self._post:
            calls = self._post[::-1]  # the latest forward's first
            self._read_ahead(self._backward_fetches(calls.index(units) + 1))

    def _on_grad(self, fqn: str) -> None:
        self._arrived(self.owner[fqn])

    def _on_inputs_done(self, units: list[int]) -> None:
        for u in units:
            if self.frozen_in[u]:
                self._arrived(u)

    def _arrived(self, u: int) -> None:
        if self.active[u]:
            self.pending[u] -= 1
            if self.pending[u] == 0:
                self.active[u] = False
                self._release(u)

    def after_backward(self) -> None:
        """Release units still held for backward and drop unused prefetches."""
        while self._kept:
            self._release(self._kept.pop())
        for u in range(len(self.units)):
            if self.active[u]:
                self.active[u] = False
                self._release(u)
        self._post.clear()
        self.drain()
        held = [self.slots[i].group.name for i, refs in enumerate(self.state.refs) if refs]
        if held:
            raise RuntimeError(f"stage 3: {len(held)} groups still held after backward "
                               f"(first: {held[0]}); a gather pre-hook ran without its release")

    def drain(self) -> None:
        """Wait for gathers in flight and drop them (their buffers are freed), and drop the
        reads ahead (the step may write the shards next)."""
        for launched in self.state.inflight.values():
            for bucket in launched:
                bucket.wait()
        self.state.inflight.clear()
        if self.hint is not None:
            self.hint([])

    def read_ahead_start(self) -> None:
        """Hint the first units of the next forward (after a step has written the shards)."""
        self._read_ahead(range(len(self.units)))

    def _backward_fetches(self, start: int) -> list[int]:
        """The units backward will fetch from its ``start``-th pre-backward on, in order: the
        post-forward calls of this forward in reverse (the order their outputs get gradients),
        each followed by the unit its pre-backward prefetches."""
        order = []
        for call in self._post[::-1][start:]:
            order += call
            if call[0] > 0 and self.ahead[call[0] - 1]:
                order.append(call[0] - 1)
        return order

    def _read_ahead(self, upcoming: Iterable[int]) -> None:
        """Hint the groups of the next ``read_ahead`` units of ``upcoming`` that need any
        (neither resident nor in flight), nearest first."""
        if self.hint is None:
            return
        st, chosen, count = self.state, {}, 0
        for u in upcoming:
            if count == self.read_ahead:
                break
            todo = [i for i in self.units[u].slots
                    if i not in st.resident and i not in st.inflight and i not in chosen]
            chosen.update(dict.fromkeys(todo))
            count += bool(todo)
        self.hint([self.slots[i] for i in chosen])

    # ------------------------------------------------------------------ groups
    def _acquire(self, u: int) -> None:
        st, slots = self.state, self.units[u].slots
        for i in slots:
            st.refs[i] += 1
        self._start(slots)
        for i in slots:
            if i not in st.resident:
                self._scatter(i, st.inflight.pop(i))

    def _keep(self, u: int) -> None:
        """After ``u``'s forward: hold it for backward (its gather's reference stays), then
        release the oldest units held while their gathered bytes exceed ``keep_bytes``."""
        if u in self._kept:  # held since an earlier forward that no backward followed
            return self._release(u)
        self._kept.append(u)
        while sum(self.unit_bytes[k] for k in self._kept) > self.keep_bytes:
            self._release(self._kept.pop(0))

    def _release(self, u: int) -> None:
        st = self.state
        for i in self.units[u].slots:
            st.refs[i] -= 1
            if st.refs[i] == 0 and i in st.resident:
                st.resident.discard(i)
                self.storage.release(i)

    def _start(self, slots: tuple[int, ...]) -> None:
        """Launch the all-gathers of the listed groups neither resident nor in flight, in
        buckets (every rank holds the same groups at the same point: the same buckets)."""
        st = self.state
        needed = tuple(i for i in slots if i not in st.resident and i not in st.inflight)
        if not needed:
            return
        shards: dict[int, torch.Tensor] = {}

        def shard_of(i: int) -> torch.Tensor:
            if i not in shards:
                shards[i] = self.fetch(self.slots[i])
            return shards[i]

        for bucket in self._plan(needed):
            launched = launch(bucket, shard_of, self.groups[bucket.channel])
            for i in dict.fromkeys(key for key, _, _ in bucket.pieces):
                st.inflight.setdefault(i, []).append(launched)

    def _plan(self, needed: tuple[int, ...]) -> tuple[GatherBucket, ...]:
        if needed not in self._plans:
            self._plans[needed] = plan_gathers(
                [(i, self.slots[i].channel, self.slots[i].columns) for i in needed],
                self.bucket_size)
        return self._plans[needed]

    def _scatter(self, i: int, launched: list[Launched]) -> None:
        """Wait for group ``i``'s buckets and copy it into its members' (re-allocated) storage."""
        self.storage.allocate(i)
        with torch.no_grad():
            for bucket in launched:
                bucket.unpack(i, self.slots[i].columns,
                              lambda lo, hi, v: self.storage.write(i, lo, hi, v))
        self.state.resident.add(i)
