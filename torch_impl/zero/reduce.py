"""Gradient reduction of every stage: buckets of group columns (``moezero.zero.buckets``),
reduced from gradient hooks while backward runs.

**Reduction.** A bucket's send buffer is [rows, cols] in the reduce dtype
(``zero_optimization.reduce_dtype``: fp32 by default, or bf16), filled from the local gradients.
The sharded optimizer (rows = dp_size) reduce-scatters it: one ``reduce_scatter_single`` (sum)
gives every rank its columns of its shard; the replicated one (one row) all-reduces it. The
sums are divided by W (docs/design.md, "Semantics": dense grads averaged over W; expert grads summed over the
EDP group and divided by W, i.e. the gradient of the global mean loss) and downcast into
``Slot.grad`` (the shard, or the whole group's range of the flat gradients; at stage 3 with
the optimizer on NVMe, ``moezero.zero.gradtier``: a swap file per group). In fp32 the sums
round once for bf16/fp16 grads; in bf16 they travel at half the bytes, are upcast to fp32 before
the division and are stepped in fp32 like any gradient (FSDP2's ``reduce_dtype``). With
``overlap_comm``, a ``register_post_accumulate_grad_hook`` on every parameter counts ready
params during the *last* micro-batch's backward (earlier ones only accumulate locally) and
launches a bucket asynchronously once all its params are ready, strictly in a fixed order per
process group (groups by the registration order of their first param, reversed: roughly when
backward finishes them), so every rank issues its collectives in the same order. A helper
thread waits for them and stores the results, freeing each send buffer early; the hooks never
block. ``reduce_gradients`` launches the rest (a missing gradient counts as zero) and waits. A
bucket's readiness needs its columns in every row, so overlap is per group: cap groups
(``max_group_size``) to overlap a large model well.
Reference counterpart: the ``psum_scatter`` of ``reference/zero.py``.
"""

from __future__ import annotations

import queue
import threading
from collections import defaultdict
from collections.abc import Sequence
from functools import partial

import torch
import torch.distributed as dist

from moezero.zero.buckets import Bucket, plan_buckets
from moezero.zero.shards import Kind, Slot, read_members

# torch 2.13 renamed the tensor forms; older versions only have the *_tensor names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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


class GradReduction:
    """Plans the buckets and reduces the local gradients into every ``Slot.grad``.

    Args:
        params: The model's params by FQN (registration order: the buckets' order).
        kinds: The optimizer's kinds; ``Kind.grads`` (a flat buffer of full local gradients,
            when kept) is read instead of ``param.grad``.
        bucket_size: ``reduce_bucket_size``, elements of one bucket's send buffer.
        overlap: Launch buckets from gradient hooks during the last micro-batch's backward.
        all_reduce: All-reduce whole groups (replicated) instead of reduce-scattering shards.
        release: Free each ``param.grad`` once every bucket reading it has been sent.
        world_size: W, the divisor of the sums.
        dtype: The reduce dtype (send buffers and sums).
        tier: ``moezero.zero.gradtier.GradTier``: the sums land there (and go to swap files)
            instead of in ``Slot.grad``.
    """

    def __init__(self, params: dict, kinds: Sequence[Kind], *, bucket_size: int, overlap: bool,
                 all_reduce: bool, release: bool, world_size: int,
                 dtype: torch.dtype = torch.float32, tier=None):
        self.params, self.kinds, self.world_size, self.dtype = params, kinds, world_size, dtype
        self._tier = tier
        self._all_reduce, self._release_sent = all_reduce, release
        self._device = next(iter(params.values())).device
        order = {fqn: i for i, fqn in enumerate(params)}
        self.buckets = plan_buckets([[s.columns for s in k.slots] for k in kinds], order,
                                    bucket_size)
        self._order: dict[str, list[int]] = defaultdict(list)
        self._buckets_of: dict[str, list[int]] = defaultdict(list)
        for i, bucket in enumerate(self.buckets):
            self._order[kinds[bucket.kind].channel].append(i)
            for fqn in bucket.fqns:
                self._buckets_of[fqn].append(i)
        self._waiter = _Waiter(self._store)
        self._reset()
        if overlap:
            for fqn, p in params.items():
                p.register_post_accumulate_grad_hook(lambda _p, fqn=fqn: self._on_grad(fqn))

    def before_backward(self, *, final: bool) -> None:
        """Called before each micro-batch's backward; ``final`` = the step's last one."""
        self._final = final

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
        if kind.dp_size == 1 and self._tier is not None and self.dtype == torch.float32:
            for si, a, b in bucket.pieces:
                slot = kind.slots[si]
                self._tier.land_into(slot, a, b, partial(self._land_own, kind, slot, a, b))
            if self._release_sent:
                self._release(bucket)
            return
        rows = kind.slots[0].columns.rows
        send = torch.zeros(rows, bucket.cols, dtype=self.dtype, device=self._device)
        col = 0
        for si, a, b in bucket.pieces:
            slot = kind.slots[si]
            for d, lo, hi in slot.columns.cells(a, b):
                self._read_grads(kind, slot, lo, hi, send[d, col:col + hi - lo])
            col += b - a
        out, work = self._collective(kind, send)
        if work is None:
            self._store(index, out, work)
        else:
            self._waiter.put((index, out, work, send))  # send stays alive until the op is done
        if self._release_sent:
            self._release(bucket)

    def _collective(self, kind: Kind, send: torch.Tensor):
        """(this rank's sums, the async work or None) of one bucket's send buffer."""
        if kind.dp_size == 1:
            return send[0], None
        if self._all_reduce:
            return send[0], dist.all_reduce(send[0], group=kind.group, async_op=True)
        out = torch.empty(send.shape[1], dtype=self.dtype, device=self._device)
        return out, _reduce_scatter(out, send.view(-1), group=kind.group, async_op=True)

    def _land_own(self, kind: Kind, slot: Slot, a: int, b: int, dst: torch.Tensor) -> None:
        """Columns [a, b) of a group no other rank holds (an expert's at ep = W: one row),
        reduced in fp32 straight into its landing buffer ``dst``: the gradients upcast, zero
        where none arrived and in the padding, divided by W. The same numbers as through a
        send buffer, without one (a zeroed copy of every expert gradient, per step)."""
        hi = min(b, slot.columns.numel)
        if kind.grads is None and any(self.params[fqn].grad is None
                                      for fqn, *_ in slot.columns.members_in(a, hi)):
            dst.zero_()
        else:
            dst[hi - a:].zero_()
        self._read_grads(kind, slot, a, hi, dst[:hi - a])
        dst.div_(self.world_size)

    def _read_grads(self, kind: Kind, slot: Slot, lo: int, hi: int, dst: torch.Tensor) -> None:
        """Copy (upcasting) the group elements [lo, hi) of the local gradients into ``dst``."""
        if kind.grads is not None:
            dst.copy_(kind.grads[slot.offset + lo:slot.offset + hi])
            return
        # no gradient (e.g. an expert that saw no token) is zero
        read_members(slot.columns, lo, hi, dst, lambda fqn: self.params[fqn].grad)

    def _release(self, bucket: Bucket) -> None:
        for fqn in bucket.fqns:
            self._unsent[fqn] -= 1
            if self._unsent[fqn] == 0:
                self.params[fqn].grad = None

    def reduce_gradients(self) -> None:
        """Launch every bucket not yet launched, wait, and store (sum / W) in the slots."""
        self._launch_ready(flush=True)
        self._waiter.join()
        self._reset()

    def _store(self, index: int, out: torch.Tensor, work, _send=None) -> None:
        """Wait for a bucket's collective; put (sum / W) into the slots' gradients."""
        if work is not None:
            work.wait()
        out = out.float()  # the sums in the reduce dtype, upcast (no copy in fp32)
        out.div_(self.world_size)
        bucket, col = self.buckets[index], 0
        for si, a, b in bucket.pieces:
            slot = self.kinds[bucket.kind].slots[si]
            if self._tier is not None:
                self._tier.land(slot, a, b, out[col:col + b - a])
            else:
                slot.grad[a:b].copy_(out[col:col + b - a])
            col += b - a

    def _reset(self) -> None:
        self._final = False
        self._waiting = [len(b.fqns) for b in self.buckets]
        self._next = dict.fromkeys(self._order, 0)
        self._unsent = defaultdict(int)
        for bucket in self.buckets:
            for fqn in bucket.fqns:
                self._unsent[fqn] += 1
