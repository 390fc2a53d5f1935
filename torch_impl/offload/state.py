"""ZeRO state in NVMe swap files: the optimizer state of the tiled step and stage-3 param shards.

One swap file per (optimizer group, state) and rank (``offload.SwapDir``, a folder this job
holds under a lock), holding exactly the
rank's padded partition of that group: ``master``/``exp_avg``/``exp_avg_sq`` in fp32; at
stage 3 with ``offload_optimizer.device: nvme`` the reduced ``grad`` in the compute dtype (not
checkpointed; ``moezero.zero.gradtier``); at stage 3 with ``offload_param.device: nvme``,
``param`` in the compute dtype, except the frozen slots a LoRA run reads from its base
checkpoint's own files (``sources``: ``moezero.offload.base_params``). The checkpoint
layout stores the same contiguous ranges, so a save or load copies file to file
(``moezero.checkpoint``, which receives the swap files' paths as the optimizer's shards).
``SwapState.stepping`` pipelines the offloaded step over windows of groups (``ZeroOptions.
host_window``): while window w is stepped, window w+1 is being read and window w-1 written
back; only those three windows' fp32 state is in memory. Host buffers are pinned when CUDA is
available (so the step's host-to-device copies are asynchronous), plain otherwise. The engine
builds these objects (``build``); ``zero.sharded.ShardedOptimizer`` only calls them.
Reference counterpart: none (the reference keeps every state in memory).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager

import torch

from moezero.memory.pinned import PinnedPool
from moezero.offload.aio import AsyncIO, aligned_empty, aligned_size, wait
from moezero.offload.base_params import BaseFiles, plan_sources
from moezero.offload.options import IOOptions
from moezero.offload.readahead import ReadAhead
from moezero.offload.swapdir import OPTIMIZER_KEY, PARAM_KEY, SwapDir
from moezero.plan.layout import STATES


class _Gate:
    """A slot a step behind the forward rewrites: ``ready`` once offered or written,
    ``written`` once its files are."""

    def __init__(self) -> None:
        self.ready, self.written = threading.Event(), threading.Event()


class SwapState:
    """Some states of every local group in swap files of one folder (one per rank)."""

    def __init__(self, folder: SwapDir, io: AsyncIO, slots: Sequence, states: tuple[str, ...],
                 dtype: torch.dtype, *, key: str, meter=None, pin: bool = False,
                 alias: str | None = None):
        self.folder, self.io, self.slots, self.states = folder, io, list(slots), states
        self.dtype, self.key, self.meter, self.pin = dtype, key, meter, pin
        # bytes requested from / to these files so far, seconds blocked waiting for them
        self.traffic = {"read": 0, "write": 0, "wait_s": 0.0}
        self._lock = threading.Lock()  # waits are counted from more than one thread
        self.ahead = ReadAhead(self)  # reads hinted before they are needed (``hint``)
        self.alias = alias  # read the files of this state instead; no files, no writes
        self.readers: list[SwapState] = []  # aliases reading these files (their reads ahead)
        self.pool = PinnedPool() if pin else None  # exact-size pinned windows, reused
        self.early: dict[tuple, tuple[list[dict], list[Future]]] = {}  # ``read_early``
        self.unwritten: dict[object, _Gate] = {}  # ``gate``: being rewritten
        self.offered: dict[object, dict[str, torch.Tensor]] = {}  # ``offer``: handed over
        self.sources = BaseFiles()  # slots read in place from a base: no file, never written

    def nbytes(self) -> int:
        """Bytes of this rank's swap files (each rounded up to the alignment)."""
        if self.alias is not None:
            return 0
        size = self.dtype.itemsize
        return sum(aligned_size(s.shard * size) for s in self.slots
                   if s not in self.sources) * len(self.states)

    def allocate(self) -> None:
        """Create (or reuse, same size) every swap file; contents are written by the caller."""
        if self.alias is not None:
            return
        for slot in [s for s in self.slots if s not in self.sources]:
            for state in self.states:
                self.folder.allocate(slot.group.name, state, slot.shard * self.dtype.itemsize)

    def path(self, slot, state: str):
        return self.folder.path(slot.group.name, self.alias or state)

    def buffers(self, slot) -> dict[str, torch.Tensor]:
        """Fresh aligned host buffers for ``slot``'s states (counted by the meter while alive;
        with ``pin``, from this state's pool of pinned buffers: ``moezero.memory.pinned``)."""
        take = self.pool.take if self.pool is not None else aligned_empty
        bufs = {s: take(slot.shard, self.dtype) for s in self.states}
        if self.meter is not None:
            self.meter.hold(sum(b.numel() * b.element_size() for b in bufs.values()))
        return bufs

    def drop(self, bufs: dict[str, torch.Tensor]) -> None:
        if self.meter is not None:
            self.meter.drop(sum(b.numel() * b.element_size() for b in bufs.values()))

    def read(self, slot, bufs: dict[str, torch.Tensor]) -> list[Future]:
        self.traffic["read"] += sum(b.nbytes for b in bufs.values())
        if slot in self.sources:  # the base checkpoint's bytes, in place
            return [self.sources.read(slot, bufs["param"])]
        return [self.io.read(self.path(slot, s), bufs[s]) for s in bufs]

    def write(self, slot, bufs: dict[str, torch.Tensor]) -> list[Future]:
        """Start writing ``bufs``; nothing with an alias (its owner writes those bytes). A read
        ahead of this slot, here or in an alias reading these files, would return stale bytes:
        it is forgotten first."""
        if self.alias is not None or slot in self.sources:
            return []
        for swap in (self, *self.readers):
            swap.ahead.forget(slot)
            swap.offered.pop(slot, None)
        for window in [w for w in self.early if slot in w]:
            self._finish(*self.early.pop(window))
        self.traffic["write"] += sum(b.nbytes for b in bufs.values())
        return [self.io.write(self.path(slot, s), bufs[s]) for s in bufs]

    def wait(self, futures: Sequence[Future]) -> None:
        """Wait for transfers of these files, counting the time blocked (``wait_s``)."""
        with self._blocked():
            wait(futures)

    @contextmanager
    def _blocked(self):
        """Count the time inside as blocked on these files (``traffic["wait_s"]``)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self.traffic["wait_s"] += time.perf_counter() - start

    def hint(self, slots: Sequence) -> None:
        """These slots will be loaded soon, nearest first: start their reads now (into fresh
        buffers, held until loaded) and drop the reads of earlier hints not among them;
        ``hint([])`` drops every read ahead (``moezero.offload.readahead``)."""
        self.ahead.hint(slots)

    def gate(self, slots: Sequence) -> None:
        """A step running behind the forward (``step_in_forward``) will rewrite these slots'
        files: ``load`` waits for each until ``offer`` or ``open``, and no read ahead starts
        before ``open``."""
        self.unwritten.update((slot, _Gate()) for slot in slots)

    def offer(self, slot, bufs: dict[str, torch.Tensor]) -> None:
        """Hand over ``slot``'s new contents (``bufs``: the bytes being written to its files,
        never changed after): its next ``load`` takes them instead of reading; a write of the
        slot drops them."""
        self.offered[slot] = bufs
        if self.meter is not None:
            self.meter.hold(sum(b.nbytes for b in bufs.values()))
        gate = self.unwritten.get(slot)
        if gate is not None:
            gate.ready.set()

    def offered_bytes(self) -> int:
        return sum(b.nbytes for bufs in list(self.offered.values()) for b in bufs.values())

    def open(self, slots: Sequence) -> None:
        """These slots' files are written: their loads and reads ahead may start."""
        for slot in slots:
            gate = self.unwritten.pop(slot, None)
            if gate is not None:
                gate.written.set()
                gate.ready.set()

    def written(self, slot) -> bool:
        """No ``gate`` holds ``slot``'s files."""
        return slot not in self.unwritten

    def _await(self, slot, what: str) -> None:
        gate = self.unwritten.get(slot)
        if gate is not None:
            with self._blocked():
                getattr(gate, what).wait()

    def load(self, slot) -> dict[str, torch.Tensor]:
        """``slot``'s states in fresh buffers: its read ahead once done, else read now (once
        its files are written, when ``gate`` holds them), or what ``offer`` handed over."""
        self._await(slot, "ready")
        if (bufs := self.offered.pop(slot, None)) is not None:
            return bufs
        self._await(slot, "written")
        bufs = self.ahead.take(slot)
        if bufs is None:
            bufs = self.buffers(slot)
            self.wait(self.read(slot, bufs))
        return bufs

    def store(self, slot, bufs: dict[str, torch.Tensor]) -> None:
        """Write ``bufs`` (a buffer per state, ``shard`` elements) to ``slot``'s files, now."""
        self.wait(self.write(slot, bufs))

    def put(self, slot, values: dict[str, torch.Tensor | float]) -> None:
        """Write each state's value (a tensor, cast to the file's dtype, or a fill number) to
        ``slot``'s files now, through aligned buffers freed afterwards (with an alias: nothing,
        the owner of those files writes them; nor for a slot read in place, whose values are
        its base's)."""
        if self.alias is not None or slot in self.sources:
            return
        bufs = self.buffers(slot)
        for state, value in values.items():
            if isinstance(value, torch.Tensor):
                bufs[state].copy_(value)
            else:
                bufs[state].fill_(value)
        self.store(slot, bufs)
        self.drop(bufs)

    def stepping(self, windows: Sequence[Sequence], written: Callable[[Sequence], None] | None = None,
                 issued: Callable[[object, dict], None] | None = None
                 ) -> Iterator[list[dict[str, torch.Tensor]]]:
        """Yield, window by window, each slot's states in host buffers; what the caller changes
        in them is written back. Reads run one window ahead, writes one window behind;
        ``issued(slot, bufs)`` once a slot's writes are started, ``written(window)`` once a
        window's writes are done."""
        ahead = None
        writing: list[tuple[list[dict], list[Future], Sequence]] = []
        for i, window in enumerate(windows):
            if ahead is None:
                ahead = self._start_read(window)
            bufs, reads = ahead
            ahead = self._start_read(windows[i + 1]) if i + 1 < len(windows) else None
            self.wait(reads)
            yield bufs
            futures = []
            for slot, b in zip(window, bufs, strict=True):
                futures += self.write(slot, b)
                if issued is not None:
                    issued(slot, b)
            writing.append((bufs, futures, window))
            while len(writing) > 1:
                self._written(*writing.pop(0), written)
        for done in writing:
            self._written(*done, written)

    def _written(self, bufs: list[dict], futures: list[Future], window: Sequence,
                 written: Callable[[Sequence], None] | None) -> None:
        self._finish(bufs, futures)
        if written is not None:
            written(window)

    def read_early(self, windows: Sequence[Sequence], budget: int) -> None:
        """Start the reads of the first ``windows`` of the next ``stepping`` whose states fit
        in ``budget`` bytes now (e.g. during backward, while the disk has time): ``stepping``
        takes them instead of reading again. Reads already started stay (a step skipped on
        fp16 overflow wrote nothing: they still hold the files' bytes); a write to one of
        their slots drops them first."""
        used = sum(b.nbytes for bufs, _ in self.early.values() for d in bufs for b in d.values())
        for window in map(tuple, windows):
            size = sum(s.shard for s in window) * self.dtype.itemsize * len(self.states)
            if window not in self.early:
                if used + size > budget:
                    return
                self.early[window] = self._start_read(window)
                used += size

    def _start_read(self, window: Sequence) -> tuple[list[dict], list[Future]]:
        if (early := self.early.pop(tuple(window), None)) is not None:
            return early
        bufs = [self.buffers(slot) for slot in window]
        return bufs, [f for slot, b in zip(window, bufs, strict=True) for f in self.read(slot, b)]

    def _finish(self, bufs: list[dict], futures: list[Future]) -> None:
        self.wait(futures)
        for b in bufs:
            self.drop(b)

    def reopen(self) -> None:
        """Close the cached descriptors of every file (after they were written behind the
        I/O engine's back, e.g. a checkpoint's file-to-file copy); the next use reopens them.
        What was handed over (``offer``), here or to a reader of these files, is dropped."""
        self.ahead.hint([])
        self.drop_early()
        for swap in (self, *self.readers):
            swap.offered.clear()
        for slot in self.slots:
            for state in self.states:
                self.io.release(self.path(slot, state))

    def drop_early(self) -> None:
        """Forget the reads ``read_early`` started (once done)."""
        while self.early:
            self._finish(*self.early.popitem()[1])

    def check_space(self, others: Sequence[SwapState] = ()) -> None:
        """One-line ``ConfigError`` before anything is written when the folder is missing,
        unwritable or too small for these files (plus ``others`` sharing the folder)."""
        same = [s for s in others if s.folder.folder == self.folder.folder]
        self.folder.check(self.nbytes() + sum(s.nbytes() for s in same), self.key)

    def close(self, *, remove: bool) -> None:
        """Stop the I/O engine (shared stores: idempotent) and, at a clean exit, remove the
        swap files."""
        self.ahead.hint([])
        self.drop_early()
        self.offered.clear()
        self.io.close()
        self.sources.close()
        if self.pool is not None:
            self.pool.close()
        if remove:
            self.folder.cleanup()


def build(cfg_zero, slots: Sequence, rank: int, dtype: torch.dtype, meter,
          options: IOOptions | None = None, *, pin: bool | None = None,
          frozen: Sequence = (), base=None) -> tuple:
    """(optimizer, param, grad: a SwapState or None each) for the configured tiers: each
    folder held by this job (``SwapDir.acquire``), checked for space (nothing is written to
    it before that passes), cleared of a dead job's other swap files, then allocated. The
    grad files (stage 3, optimizer on NVMe: ``moezero.zero.gradtier``) share the optimizer's
    folder and have no meter (the tier counts its buffers). In fp32 with both tiers in one
    folder the params are read from the master files (``params_read_master``).
    ``pin``: pin the host buffers (default: where CUDA is available). ``frozen``: the frozen
    groups' slots (``train.freeze``): param files only (stage 3), so then the params never
    read the master's files; with ``base`` (a LoRA run's base step directory) those its
    files hold are read from there instead (``base_params.plan_sources``)."""
    optim = param = grad = io = None
    pin = torch.cuda.is_available() if pin is None else pin
    options = options or IOOptions()
    new_io = lambda: AsyncIO(chunk_bytes=options.chunk_bytes, direct=options.direct_io)
    folders: dict[str, SwapDir] = {}  # one per path: both tiers may share a folder
    folder = lambda path: folders.setdefault(os.path.abspath(path), SwapDir(path, rank))
    if cfg_zero.offload_optimizer.device == "nvme":
        io = new_io()
        where = folder(cfg_zero.offload_optimizer.nvme_path)
        optim = SwapState(where, io, slots, STATES, torch.float32, key=OPTIMIZER_KEY,
                          meter=meter, pin=pin)
        if cfg_zero.stage == 3:
            grad = SwapState(where, io, slots, ("grad",), dtype, key=OPTIMIZER_KEY, pin=pin)
    if cfg_zero.stage == 3 and cfg_zero.offload_param.device == "nvme":
        io = io or new_io()
        alias = "master" if params_read_master(cfg_zero, fp32=dtype == torch.float32) \
            and not frozen else None
        param = SwapState(folder(cfg_zero.offload_param.nvme_path), io, [*slots, *frozen],
                          ("param",), dtype,
                          key=PARAM_KEY, meter=meter, pin=pin, alias=alias)
        if param.alias is not None:
            optim.readers.append(param)  # the step's master writes forget its reads ahead
        if base is not None:
            param.sources = plan_sources(base, frozen, options)
    _prepare([s for s in (optim, param, grad) if s is not None], folders.values())
    return optim, param, grad


def params_read_master(cfg_zero, *, fp32: bool) -> bool:
    """fp32 with params and optimizer both on NVMe in one folder: the param shard is the
    master's bytes, so the params read the master's swap files (no file of their own, no write
    after the step). From the config alone (``moezero.estimate`` sizes the files by it)."""
    optim, param = cfg_zero.offload_optimizer, cfg_zero.offload_param
    return fp32 and optim.device == param.device == "nvme" \
        and os.path.abspath(optim.nvme_path) == os.path.abspath(param.nvme_path)


def _prepare(stores: list[SwapState], folders) -> None:
    """Hold and check every folder, prune and allocate the swap files; on any failure (a
    refusal, or space another job took after the check) every folder is removed again with
    what this job put in it, so a job that failed to start leaves no swap folder."""
    try:
        for s in stores:
            s.folder.check_path(s.key)
            s.folder.acquire()
        for s in stores:
            s.check_space([o for o in stores if o is not s])
        for f in folders:
            f.prune({s.path(slot, st).name for s in stores if s.folder is f
                     for slot in s.slots for st in s.states})
        for s in stores:
            s.allocate()
    except Exception:
        for f in folders:
            f.cleanup()
        raise


def check_paths(cfg_zero, *, numel: int, share: float, param_bytes: int, frozen: int = 0,
                in_place: bool = False) -> None:
    """Before any rank starts: each NVMe folder exists, is a writable directory and has room
    for what this node's ranks will swap there: their ``share`` of the model's ``numel``
    elements at 12 B (fp32 master + moments; at stage 3 plus ``param_bytes`` of reduced
    gradient) and, at stage 3, ``param_bytes`` of param shard (alignment aside; each rank
    checks its exact size again). ``frozen`` elements have no optimizer state (nor, with
    ``in_place``, a param file). One-line ``ConfigError`` naming the key and path; writes
    nothing."""
    need: dict[str, list] = {}
    grad_bytes = param_bytes if cfg_zero.stage == 3 else 0
    tiers = [(cfg_zero.offload_optimizer, OPTIMIZER_KEY, 12 + grad_bytes, numel - frozen)]
    if cfg_zero.stage == 3:
        tiers.append((cfg_zero.offload_param, PARAM_KEY, param_bytes,
                      numel - (frozen if in_place else 0)))
    for tier, key, per_elem, count in tiers:
        if tier.device == "nvme":
            entry = need.setdefault(os.path.abspath(tier.nvme_path), [key, 0])
            entry[1] += int(per_elem * count * share)
    for path, (key, nbytes) in need.items():
        SwapDir(path, 0).check(nbytes, key)
