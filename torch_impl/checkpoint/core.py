"""Checkpoints of a training engine: the plan's layout, written rank by rank (docs/checkpoint.md).

Every rank computes the layout (``moezero.plan.layout.plan_layout``) from the engine's
optimizer groups; rank 0 creates the ``step_XXXXXXXX.partial/`` directory and every file's
header; each rank writes its own fp32 partition of every group it holds (master, exp_avg,
exp_avg_sq, straight from its ZeRO shards, or at stage 0 its DP slice of the replicated
state) with ``store.write_partition`` (the aligned bulk of each large range with O_DIRECT:
``ckpt_write.RangeWriter``) and flushes once (``ckpt_write.FolderFlush``); rank 0 gathers the
checksummed ranges, writes the manifest and commits atomically. Loading reads each rank's
shard under the *current* plan with
``store.read_shard``, whatever world size, ``ep``, stage or group cap saved it, then derives
the compute-dtype params from the fp32 master. Only JSON and safetensors are ever read.

Coordination uses a dedicated gloo process group (``Checkpointer.group``, created with the
engine) that carries JSON only: the header status, the range records and RNG states, and the
outcome of the commit, so every rank raises the same one-line ``CheckpointError`` when any
rank fails. With ``checkpoint.async`` the shards are cloned to host memory at the step
boundary and the whole protocol (files, collectives on that group, commit) runs on one
background thread per rank, while training continues on the world's other groups; at most
one save is in flight (the next save, a load or ``wait`` joins it first).

Reference counterpart: ``moezero.plan.store`` (the byte mover this module drives).
"""

from __future__ import annotations

import base64
import json
import os
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from moezero.checkpoint import writer as ckpt_write
from moezero.checkpoint.buffers import buffer_shapes, buffer_values, read_buffers
from moezero.plan import plan_layout, store
from moezero.plan.buffer_io import check_buffers, write_buffers
from moezero.plan.layout import STATES, Layout, RangeRecord, rank_ranges
from moezero.plan.partition import Partition
from moezero.plan.specs import UserGroup
from moezero.plan.store import CheckpointError, check_shapes, find_checkpoint
from moezero.zero.groups import param_specs

__all__ = ["Checkpointer", "CheckpointError", "check_shapes", "find_checkpoint", "load",
           "resolve_load", "save"]

TEST_DELAY_ENV = "MOEZERO_TEST_CKPT_DELAY_S"
"""Test hook: seconds to sleep before each partition write, the manifest and the commit, so
crash tests can land a SIGKILL inside a save. Unset (0) in normal use."""


def _test_delay() -> None:
    delay = float(os.environ.get(TEST_DELAY_ENV, "0") or 0)
    if delay > 0:
        time.sleep(delay)


# ---------------------------------------------------------------- coordination


class Checkpointer:
    """Per-engine checkpoint context: the gloo group for checkpoint traffic and the writer
    thread of an async save. Create it on every rank (``new_group`` is collective)."""

    def __init__(self, rank: int, world_size: int, model: torch.nn.Module | None = None):
        self.rank, self.world_size = rank, world_size
        self.group = dist.new_group(backend="gloo") if world_size > 1 else None
        self._thread: threading.Thread | None = None
        self._result: Path | None = None
        self._error: BaseException | None = None
        # the global shapes are static: taken now, not inside the first save
        self._shapes = model_shapes(model) if model is not None else None

    def all_gather(self, obj) -> list:
        """Every rank's JSON-able ``obj`` in rank order (JSON bytes over gloo, no pickle)."""
        if self.world_size == 1:
            return [obj]
        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self.group)
        cap = max(int(s) for s in sizes)
        buf = torch.zeros(cap, dtype=torch.uint8)
        buf[:data.numel()] = data
        out = [torch.empty(cap, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(out, buf, group=self.group)
        return [json.loads(bytes(o[:int(s)].numpy())) for o, s in zip(out, sizes, strict=True)]

    def agree(self, error: str | None, what: str) -> None:
        """Raise the first rank's error on every rank (collective), or return if none failed."""
        errors = [e for e in self.all_gather(error) if e]
        if errors:
            raise CheckpointError(f"{what}: {errors[0]}")

    def start(self, job: _SaveJob, *, background: bool) -> Path:
        """Run a save now, or on the writer thread after the previous one finished."""
        self.wait()
        if not background:
            return _write(self, job)
        self._thread = threading.Thread(target=self._run, args=(job,), daemon=True,
                                        name="moezero-checkpoint")
        self._thread.start()
        return Path(job.root) / store.step_dir_name(job.step)

    def _run(self, job: _SaveJob) -> None:
        try:
            self._result = _write(self, job)
        except BaseException as exc:  # re-raised on the training thread by wait()
            self._error = exc

    def wait(self) -> Path | None:
        """Finish the save in flight, if any; returns its directory (raises its error)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
        result, self._result = self._result, None
        return result

    def shapes(self, model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
        """Full shapes of every parameter of the global model (every expert)."""
        if self._shapes is None:
            self._shapes = model_shapes(model)
        return self._shapes


def model_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """``{fqn: shape}`` of the global model (experts of every EP rank), as the plan sees it."""
    specs, _ = param_specs(model, lambda fqn, p: UserGroup("all"))
    return {s.fqn: s.shape for s in specs}


# ---------------------------------------------------------------- snapshot


@dataclass
class _Shard:
    """This rank's fp32 partition of one group (``shard_numel`` elements per state, padding
    included; a master that is the params' own range holds only the real elements):
    in memory (``arrays``) or, NVMe-offloaded, in swap files (``files``: state -> path)."""

    partition: Partition
    dp_rank: int
    arrays: dict[str, np.ndarray] | None = None
    files: dict[str, Path] | None = None


@dataclass
class _SaveJob:
    root: str
    step: int
    keep_last: int
    layout: Layout
    shards: list[_Shard]
    rng: dict  # this rank's generator states
    meta: dict  # config, topology, state (rank 0's is written)
    buffers: dict  # {fqn: fp32 copy} of the buffers (rank 0 writes them)


def _host(t: torch.Tensor, copy: bool) -> np.ndarray:
    t = t.detach()
    if t.device.type != "cpu" or copy:
        t = t.to("cpu", copy=True)
    return t.numpy()


def snapshot(engine, *, copy: bool) -> list[_Shard]:
    """This rank's partitions as fp32 numpy arrays: views of the ZeRO shards (``copy``: clones)
    or, at stage 0, its DP slice of the replicated per-parameter state."""
    swap = engine.zero.optim_swap if engine.zero is not None else None
    if swap is not None:  # the swap files hold the same ranges: copied file to file
        return [_Shard(slot.group.partition, slot.dp_rank,
                       files={s: swap.path(slot, s) for s in STATES}) for slot in engine.zero.slots]
    if engine.zero is not None:
        return [_Shard(part, dp_rank, {s: _host(t, copy) for s, t in arrays.items()})
                for part, dp_rank, arrays in engine.zero.shards()]
    shards = []
    for group in engine.groups.local:
        part = group.partition
        dp_rank = part.dp_rank(engine.topology.rank)
        arrays = {s: np.zeros(part.shard_numel, np.float32) for s in STATES}
        for piece, at in part.rank_slices(dp_rank):
            st = engine.state[piece.fqn]
            for s in STATES:
                src = getattr(st, s).detach().reshape(-1)[piece.start:piece.stop]
                arrays[s][at:at + piece.numel] = src.cpu().numpy()
        shards.append(_Shard(part, dp_rank, arrays))
    return shards


def _rng_state() -> dict:
    b64 = lambda t: base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")
    state = {"torch_cpu": b64(torch.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = b64(torch.cuda.get_rng_state())
    return state


def _set_rng_state(state: dict) -> None:
    unb64 = lambda s: torch.from_numpy(np.frombuffer(base64.b64decode(s), np.uint8).copy())
    torch.set_rng_state(unb64(state["torch_cpu"]))
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(unb64(state["torch_cuda"]))


def engine_state(engine) -> dict:
    """Counters of the engine that a resume needs (JSON; the LR schedule is a function of
    ``step_count``)."""
    return {"step_count": engine.step_count, "global_steps": engine.global_steps,
            "lr_step": engine.step_count, "lr": engine.current_lr(),
            "loss_scaler": engine.scaler.state_dict()}


def topology_of(engine) -> dict:
    zero = engine.cfg.zero_optimization
    return {"world_size": engine.topology.world_size, "ep_sizes": list(engine.topology.ep_sizes),
            "zero_stage": zero.stage, "dtype": str(engine.dtype).removeprefix("torch."),
            "offload_optimizer": zero.offload_optimizer.device,
            "max_group_size": engine.cfg.moe.max_group_size,
            "split_groups_by_expert": engine.cfg.moe.split_groups_by_expert}


# ---------------------------------------------------------------- save


def save(engine, root: str | os.PathLike, *, step: int, state: dict | None = None,
         background: bool | None = None) -> Path:
    """Save the engine's fp32 state at ``step`` under ``root`` (collective: every rank calls it).

    Args:
        engine: The training engine (``moezero.engine.Engine``).
        root: The checkpoint root; the save goes to ``root/step_XXXXXXXX/`` and ``latest``.
        step: The step the directory is named by.
        state: The caller's JSON state (e.g. ``{"data": batches.state_dict()}``), returned by
            ``load``; rank 0's is written.
        background: Write on a background thread (default ``checkpoint.async``).

    Returns:
        The step directory (committed when this returns, unless in the background).

    Raises:
        CheckpointError: (one line, on every rank) when any rank failed to write.
    """
    if background is None:
        background = engine.cfg.checkpoint.async_save
    if engine.zero is not None and engine.zero.optim_swap is not None:
        background = False  # the next step rewrites the swap files that the save copies
    ckpt = engine.checkpointer
    buffers = buffer_values(engine.model) if ckpt.rank == 0 else {}
    layout = plan_layout(engine.groups.plan, ckpt.shapes(engine.model), step=step,
                         buffers=buffer_shapes(engine.model))
    meta = {"config": engine.cfg.model_dump(by_alias=True, mode="json"),
            "topology": topology_of(engine),
            "state": {"engine": engine_state(engine), "client": state or {}}}
    json.dumps(meta, allow_nan=False)  # fail now, on the caller's thread, if not strict JSON
    job = _SaveJob(os.fspath(root), step, engine.cfg.checkpoint.keep_last, layout,
                   snapshot(engine, copy=background), _rng_state(), meta, buffers)
    return ckpt.start(job, background=background)


def _write(ckpt: Checkpointer, job: _SaveJob) -> Path:
    """The save protocol of docs/checkpoint.md; every rank agrees on each failure."""
    what = f"checkpoint save of step {job.step} under {job.root}"
    partial, error = Path(job.root) / (store.step_dir_name(job.step) + store.PARTIAL), None
    headers, flush = [], None
    if ckpt.rank == 0:
        try:
            partial = store.begin_save(job.root, job.step)
            flush = ckpt_write.FolderFlush(partial)  # before the first write (error mark)
            headers = store.write_headers(job.layout, partial)
            headers += write_buffers(partial, job.layout, job.buffers)
        except Exception as exc:
            error = _one_line(exc)
    try:
        ckpt.agree(error, what)
        records, error = _write_partitions(ckpt, job, partial, flush)
    finally:
        if flush is not None:
            flush.close()
    gathered = ckpt.all_gather({"error": error, "records": [list(r) for r in records],
                                "rng": job.rng})
    error = next((g["error"] for g in gathered if g["error"]), None)
    final = Path(job.root) / store.step_dir_name(job.step)
    if ckpt.rank == 0 and error is None:
        try:
            _finish(job, partial, headers, gathered)
        except Exception as exc:
            error = _one_line(exc)
    outcome = ckpt.all_gather(error)[0]
    if outcome:
        raise CheckpointError(f"{what}: {outcome}")
    return final


def _write_partitions(ckpt: Checkpointer, job: _SaveJob, partial: Path,
                      flush: ckpt_write.FolderFlush | None) -> tuple[list, str | None]:
    """This rank's ranges, flushed: (records, None), or what has been written and the error."""
    records = []
    try:
        with flush or ckpt_write.FolderFlush(partial) as flush:
            with ckpt_write.RangeWriter(ckpt_write.DIRECT_IO, ckpt_write.STAGE_BYTES,
                                        ckpt_write.DIRECT_MIN_BYTES) as writer:
                for shard in job.shards:
                    _test_delay()
                    if shard.files is not None:
                        records += _copy_partition(partial, job.layout, shard)
                    else:
                        records += store.write_partition(partial, job.layout, shard.partition,
                                                         shard.dp_rank, **shard.arrays,
                                                         fsync=False, writer=writer)
            written = {r.file for r in records}  # every write has finished
            if ckpt.rank == 0:  # it wrote every header: commit need not flush them again
                written.update(f.name for f in job.layout.files)
            flush.flush(sorted(written))
    except Exception as exc:
        return records, f"rank {ckpt.rank}: {_one_line(exc)}"
    return records, None


def _copy_partition(ckpt_dir: Path, layout: Layout, shard: _Shard) -> list:
    """A swapped shard's real elements, swap file -> checkpoint file (``os.copy_file_range``),
    with the checksum of each range."""
    ranges = rank_ranges(layout, shard.partition, shard.dp_rank)
    records = []
    for state in STATES:
        where = getattr(ranges, state)
        if where is not None and where.length:
            crc = store.copy_range(shard.files[state], 0, ckpt_dir / where.file, where.offset,
                                   where.length)
            records.append(RangeRecord(where.file, where.offset, where.length, crc))
    return records


def _finish(job: _SaveJob, partial: Path, headers: list, gathered: list[dict]) -> None:
    """Rank 0: manifest, commit, retention."""
    records = headers + [tuple(r) for g in gathered for r in g["records"]]
    state = dict(job.meta["state"], rng=[g["rng"] for g in gathered])
    _test_delay()
    store.write_manifest(partial, job.layout, checksums=records, config=job.meta["config"],
                         topology=job.meta["topology"], state=state)
    _test_delay()
    final = store.commit(partial, flushed=True, layout=job.layout)  # every rank flushed
    store.apply_retention(job.root, job.keep_last, committed=final)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if isinstance(exc, (CheckpointError, OSError)) else f"{type(exc).__name__}: {text}"


# ---------------------------------------------------------------- load


def resolve_load(value: str, root: str | os.PathLike) -> Path:
    """``checkpoint.load`` to a checked step directory: ``latest`` is the newest complete one
    under ``root``; a relative path is looked up under ``root`` first, then the working dir."""
    root = Path(root)
    if value == "latest":
        if not root.is_dir():
            raise CheckpointError(f"checkpoint.load: latest: no checkpoint root {root}")
        path = root
    else:
        path = Path(value)
        if not path.is_absolute() and (root / path).exists():
            path = root / path
        elif not path.exists():
            where = "" if path.is_absolute() else f" (looked under {root} and the working directory)"
            raise CheckpointError(f"checkpoint.load: {value}: no such checkpoint directory{where}")
    try:
        ckpt = find_checkpoint(path)
        store.read_manifest(ckpt)
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint.load: {exc}") from None
    return ckpt


def load(engine, path: str | os.PathLike) -> dict:
    """Load a checkpoint into the engine (collective: every rank calls it).

    ``path`` is a step directory or a checkpoint root (its newest complete checkpoint). Any
    world size, ``ep``, ZeRO stage or group cap may have saved it. Restores the fp32 master
    and moments of this rank's shards, derives the compute params from the master, and sets
    the step counters, loss scaler and RNG. A weights-only checkpoint (``moezero import-hf``)
    sets the masters only: the moments start at zero, the counters at 0, RNG and loss scaler
    are left as they are, and the returned state is empty (a fine-tune from step 0).

    The manifest and shapes are checked before anything is read; a read that fails after
    that (a damaged file) leaves the engine's state partly loaded (in fp32 at stages 0-2 the
    masters are the params themselves): load again or rebuild the engine.

    Returns:
        The caller's state given to ``save`` (e.g. ``{"data": ...}``).
    """
    ckpt = engine.checkpointer
    ckpt.wait()
    error, manifest = None, None
    try:
        where = find_checkpoint(path)
        manifest = store.read_manifest(where)
        check_shapes(manifest, ckpt.shapes(engine.model), where)
        check_buffers(manifest, buffer_shapes(engine.model), where)
        _read_state(engine, where, manifest)
        read_buffers(engine.model, where, manifest)
    except (CheckpointError, OSError, ValueError) as exc:
        error = f"rank {engine.topology.rank}: {_one_line(exc)}"
    ckpt.agree(error, f"checkpoint load from {path}")
    if engine.zero is not None:
        engine.zero.params_from_master()
    else:
        for fqn, st in engine.state.items():
            param = engine.params[fqn]
            if st.master is not param.data:
                param.data.copy_(st.master)
    if manifest.layout.weights_only:
        _restore_counters(engine, {}, engine.topology.rank)
        return {}
    _restore_counters(engine, manifest.state, engine.topology.rank)
    return manifest.state.get("client", {})


def _read_into(tensor: torch.Tensor, read, numel: int | None = None) -> None:
    """``read(out=...)`` of ``numel`` elements (default: the tensor's) into a float32 tensor,
    through a host buffer when not on the CPU or when the tensor holds fewer elements (a
    master that is the params' range: the shard without its padding)."""
    numel = tensor.numel() if numel is None else numel
    if tensor.device.type == "cpu" and tensor.numel() == numel:
        read(out=tensor.detach().reshape(-1).numpy())
        return
    host = np.empty(numel, np.float32)
    read(out=host)
    tensor.detach().view(-1).copy_(torch.from_numpy(host[:tensor.numel()]))


def _read_state(engine, where: Path, manifest) -> None:
    """Each state of this rank's shards from the checkpoint; a state the checkpoint lacks
    (the moments of a weights-only one) is zeroed."""
    saved = ("master",) if manifest.layout.weights_only else STATES
    if engine.zero is not None:
        swap, slots = engine.zero.optim_swap, engine.zero.slots
        if swap is not None:  # NVMe: file to file where the group is unchanged
            slots = [slot for slot in slots if not swap.fill_from_checkpoint(slot, where, manifest)]
        for part, dp_rank, arrays in engine.zero.shards(slots):
            for s, t in arrays.items():
                if s not in saved:
                    t.detach().zero_()
                    continue
                _read_into(t, partial(store.read_shard, where, manifest, part, dp_rank, s),
                           part.shard_numel)
        return
    for fqn, st in engine.state.items():
        for s in STATES:
            if s not in saved:
                getattr(st, s).detach().zero_()
                continue
            _read_into(getattr(st, s), partial(store.read_param, where, manifest, fqn, state=s))


def _restore_counters(engine, state: dict, rank: int) -> None:
    counters = state.get("engine", {})
    engine.step_count = int(counters.get("step_count", 0))
    engine.global_steps = int(counters.get("global_steps", engine.step_count))
    if "loss_scaler" in counters:
        engine.scaler.load_state_dict(counters["loss_scaler"])
    rngs = state.get("rng") or []
    if rngs:  # a rank that did not exist at save takes the state of rank % saved world
        _set_rng_state(rngs[rank % len(rngs)])
