"""Gradient reduction of ZeRO stages 1-3: buckets of partition columns, reduce-scattered from
gradient hooks while backward runs.

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
Reference counterpart: the ``psum_scatter`` of ``reference/zero.py``.
"""

from __future__ import annotations

import queue
import threading
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moezero.zero.shards import Kind, Slot

# torch 2.13 renamed the tensor forms; older versions only have the *_tensor names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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


class GradReduction:
    """Mixin of ``zero.ZeroOptimizer``: plans the buckets and reduces gradients into the grad
    partitions (``Slot.grad``). Needs ``params``, ``kinds``, ``stage``, ``topology``, ``_where``
    and ``_device`` from the optimizer; ``_init_reduction`` after the kinds are built."""

    def _init_reduction(self, bucket_size: int, overlap: bool) -> None:
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
            for fqn, p in self.params.items():
                p.register_post_accumulate_grad_hook(lambda _p, fqn=fqn: self._on_grad(fqn))

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

    def before_backward(self, *, final: bool) -> None:
        """Called before each micro-batch's backward; ``final`` = the step's last one."""
        self._final = final
        if self.stage == 1:
            self._attach_grad_views()

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

    def _read_grads(self, kind: Kind, slot: Slot, lo: int, hi: int, dst: torch.Tensor) -> None:
        """Copy (upcasting) the group elements [lo, hi) of the local gradients into ``dst``."""
        if kind.grads is not None:
            dst.copy_(kind.grads[slot.offset + lo:slot.offset + hi])
            return
        # no gradient (e.g. an expert that saw no token) is zero
        self._read_members(slot, lo, hi, dst, lambda fqn: self.params[fqn].grad)

    @staticmethod
    def _read_members(slot: Slot, lo: int, hi: int, dst: torch.Tensor, tensor_of) -> None:
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
