"""Saving a checkpoint: the plan's layout written rank by rank (docs/checkpoint.md).

The saver receives state, never the engine: the layout (``moezero.plan.plan_layout`` of the
optimizer groups), this rank's fp32 shards (``plan.state_shard.StateShard``: tensors, or the
NVMe swap files that hold the same ranges) and the engine's small JSON state (``Engine.state_dict``
plus the caller's). Rank 0 creates the ``step_XXXXXXXX.partial/`` directory and every file's
header; each rank writes its own fp32 partition of every group it holds (master, exp_avg,
exp_avg_sq) through its ``writer.SaveWriter`` (``store.write_partition``, the aligned bulk of
each large range with O_DIRECT by ``writer.RangeWriter``, or its swap files copied file to
file) and flushes once (``writer.FolderFlush``); rank 0 gathers the checksummed ranges and the
per-rank state (``RANK_KEYS``), writes the manifest and commits atomically (through the same
``SaveWriter``). Every failure is agreed on over
the checkpoint group, so every rank raises the same one-line ``CheckpointError``.
Reference counterpart: ``moezero.plan.store`` (the byte mover this module drives) and
``moezero.reference.checkpoint.save_train_state``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moezero.checkpoint import writer as ckpt_write
from moezero.checkpoint.options import CheckpointOptions
from moezero.checkpoint.ranks import CheckpointGroup, failure
from moezero.plan import store
from moezero.plan.layout import Layout
from moezero.plan.model_buffer_io import write_buffers
from moezero.plan.partition import Partition
from moezero.plan.state_shard import StateShard
from moezero.plan.store import CheckpointError

RANK_KEYS = ("rng",)
"""Entries of the saved state that each rank has its own of (its generator states): gathered
into a list in rank order; on load a rank takes entry ``rank % saved world``."""


@dataclass
class _Shard:
    """This rank's fp32 partition of one group as numpy arrays (``shard_numel`` elements per
    state, padding included, or at least the real elements) or swap files (state -> path)."""

    partition: Partition
    dp_rank: int
    arrays: dict[str, np.ndarray] | None = None
    files: dict[str, Path] | None = None


@dataclass
class SaveJob:
    """Everything one save writes, taken at the step boundary (a background save's shards are
    copies)."""

    root: str
    step: int
    layout: Layout
    shards: list[_Shard]
    state: dict  # the shared state (rank 0's is written)
    rank_state: dict  # this rank's entries of RANK_KEYS
    meta: dict  # {"config": ..., "topology": ...} (rank 0's is written)
    buffers: dict  # {fqn: fp32 array} of the checkpointed buffers (rank 0 writes them)
    owned: frozenset[Path] | None = None  # the steps retention may delete (None: any)


def _host(t: torch.Tensor, copy: bool) -> np.ndarray:
    t = t.detach()
    if t.device.type != "cpu" or copy:
        t = t.to("cpu", copy=True)
    return t.numpy()


def make_job(root, step: int, layout: Layout, shards: Iterable[StateShard], state: dict,
             meta: dict, buffers: dict, *, copy: bool) -> SaveJob:
    """The job of one save: ``shards`` as numpy views (``copy``: host copies) or swap files;
    ``state`` split into the shared part and this rank's ``RANK_KEYS``. Raises ValueError on
    the caller's thread when the state or meta is not strict JSON."""
    shared = {k: v for k, v in state.items() if k not in RANK_KEYS}
    mine = {k: v for k, v in state.items() if k in RANK_KEYS}
    json.dumps([shared, mine, meta], allow_nan=False)
    arrays = [_Shard(s.partition, s.dp_rank, files=dict(s.files)) if s.files is not None else
              _Shard(s.partition, s.dp_rank, {k: _host(t, copy) for k, t in s.tensors.items()})
              for s in shards]
    return SaveJob(os.fspath(root), step, layout, arrays, shared, mine, meta,
                   {k: np.array(v, np.float32) for k, v in buffers.items()})


def write(group: CheckpointGroup, job: SaveJob, options: CheckpointOptions,
          refused: set[int]) -> Path:
    """The save protocol of docs/checkpoint.md; every rank agrees on each failure, and a
    failed save's ``.partial`` directory is removed (by rank 0, once every rank has stopped
    writing: failures are agreed after the writes), so it holds no space; ``latest`` and the
    committed checkpoints are untouched.

    ``refused``: ``st_dev`` of filesystems where O_DIRECT was refused (kept by the caller
    across saves). The writes go through ``options.io.save_writer`` (``writer.SaveWriter``
    when None; a test's writer injects faults).
    """
    partial = Path(job.root) / (store.step_dir_name(job.step) + store.PARTIAL)
    try:
        return _protocol(group, job, options, refused, partial)
    except CheckpointError:
        if group.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise


def _protocol(group: CheckpointGroup, job: SaveJob, options: CheckpointOptions,
              refused: set[int], partial: Path) -> Path:
    what = f"checkpoint save of step {job.step} under {job.root}"
    disk = (options.io.save_writer or ckpt_write.SaveWriter)(options.io, refused,
                                                             rank=group.rank, step=job.step)
    error, headers, flush = None, [], None
    if group.rank == 0:
        try:
            partial = store.begin_save(job.root, job.step)
            flush = _folder_flush(partial, options)  # before the first write (error mark)
            headers = store.write_headers(job.layout, partial)
            headers += write_buffers(partial, job.layout, job.buffers)
        except Exception as exc:
            error = failure(ckpt_write.named(exc, partial), 0)
    try:
        group.agree(error, what)
        records, error = _write_partitions(disk, job, partial, flush, options)
    finally:
        if flush is not None:
            flush.close()
    gathered = group.all_gather({"error": error, "records": [list(r) for r in records],
                                 "state": job.rank_state})
    error = next((g["error"] for g in gathered if g["error"]), None)
    if group.rank == 0 and error is None:
        try:
            _finish(disk, job, partial, headers, gathered, options)
        except Exception as exc:
            error = failure(ckpt_write.named(exc, partial), 0)
    outcome = group.all_gather(error)[0]
    if outcome:
        raise CheckpointError(f"{what}: {outcome}")
    return Path(job.root) / store.step_dir_name(job.step)


def _folder_flush(folder: Path, options: CheckpointOptions) -> ckpt_write.FolderFlush:
    return ckpt_write.FolderFlush(folder, ckpt_write.system_syncfs() if options.io.syncfs
                                  else None)


def _write_partitions(disk: ckpt_write.SaveWriter, job: SaveJob, partial: Path,
                      flush: ckpt_write.FolderFlush | None,
                      options: CheckpointOptions) -> tuple[list, str | None]:
    """This rank's ranges, flushed: (records, None), or what has been written and the error."""
    records = []
    try:
        with flush or _folder_flush(partial, options) as flush:
            with disk:
                for shard in job.shards:
                    records += disk.shard(partial, job.layout, shard.partition, shard.dp_rank,
                                          arrays=shard.arrays, files=shard.files)
            written = {r.file for r in records}  # every write has finished
            if disk.rank == 0:  # it wrote every header: commit need not flush them again
                written.update(f.name for f in job.layout.files)
            flush.flush(sorted(written))
    except Exception as exc:
        return records, failure(ckpt_write.named(exc, partial), disk.rank)
    return records, None


def _finish(disk: ckpt_write.SaveWriter, job: SaveJob, partial: Path, headers: list,
            gathered: list[dict], options: CheckpointOptions) -> None:
    """Rank 0: manifest (the shared state plus every rank's entries), commit, retention."""
    records = headers + [tuple(r) for g in gathered for r in g["records"]]
    state = dict(job.state, **{k: [g["state"].get(k) for g in gathered]
                               for k in RANK_KEYS if k in job.rank_state})
    disk.manifest(partial, job.layout, checksums=records, config=job.meta["config"],
                  topology=job.meta["topology"], state=state, base=job.meta.get("base"))
    final = disk.commit(partial, job.layout)  # every rank flushed
    store.apply_retention(job.root, options.keep_last, committed=final, owned=job.owned)
