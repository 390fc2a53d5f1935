"""Checkpoints of training state: the plan's layout, written rank by rank (docs/checkpoint.md).

``Checkpointer`` is the per-engine context: the gloo group for checkpoint traffic
(``ranks.CheckpointGroup``), the options (``options.CheckpointOptions``) and the writer thread
of an async save. It receives state, never the engine (as DCP's ``save(state_dict,
storage_writer)``): ``save`` takes the layout, this rank's fp32 shards
(``plan.state_shard.StateShard``) and the engine's small JSON state
(``Engine.state_dict()`` plus the caller's); ``load`` takes the targets to fill and returns
this rank's state, which the engine gives to ``Engine.load_state_dict``. The protocols are
``save.write`` and ``load.read_checkpoint``. With ``background`` the shards are cloned to host memory at the
step boundary and the whole save (files, collectives on the checkpoint group, commit) runs on
one background thread per rank, while training continues on the world's other groups; at most
one save is in flight (the next save, a load or ``wait`` joins it first). Shards in NVMe swap
files are saved in the foreground: the next step rewrites the files the save copies.
Reference counterpart: ``moezero.plan.store`` (the byte mover) and
``moezero.reference.checkpoint`` (the JAX side's saver and loader).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterable
from pathlib import Path

import torch

from moezero.checkpoint import save as saving
from moezero.checkpoint.load import read_checkpoint, resolve_load
from moezero.checkpoint.options import CheckpointOptions
from moezero.checkpoint.ranks import CheckpointGroup, one_line
from moezero.model.specs import param_specs
from moezero.plan import store
from moezero.plan.layout import Layout
from moezero.plan.specs import UserGroup
from moezero.plan.state_shard import StateShard
from moezero.plan.store import CheckpointError, check_shapes, find_checkpoint

__all__ = ["CheckpointError", "Checkpointer", "check_shapes", "find_checkpoint", "model_shapes",
           "resolve_load"]


class Checkpointer:
    """Saves and loads one engine's state. Create it on every rank (``new_group`` is
    collective). Saves write through ``options.io.save_writer`` (``writer.SaveWriter``)."""

    def __init__(self, rank: int, world_size: int, options: CheckpointOptions | None = None):
        self.rank, self.options = rank, options or CheckpointOptions()
        self.group = CheckpointGroup(rank, world_size)
        self.refused: set[int] = set()  # st_dev of filesystems that refused O_DIRECT
        self._thread: threading.Thread | None = None
        self._result: Path | None = None
        self._error: BaseException | None = None
        self.owned: set[Path] = set()  # the steps this run wrote or resumed from (``adopt``)

    def adopt(self, path: str | os.PathLike) -> None:
        """This run resumes the checkpoint at ``path``: the complete steps of its root are
        the resumed run's, which retention may delete (``keep_last``); nothing else is.
        Rank 0 alone applies retention, so only it lists them."""
        if self.rank == 0:
            root = store.find_checkpoint(path).parent
            self.owned.update(p.resolve() for p in store.complete_steps(root))

    def save(self, root: str | os.PathLike, *, step: int, layout: Layout,
             shards: Iterable[StateShard], state: dict, meta: dict,
             buffers: dict | None = None, background: bool | None = None) -> Path:
        """Save at ``step`` under ``root`` (collective: every rank calls it).

        Args:
            root: The checkpoint root; the save goes to ``root/step_XXXXXXXX/`` and ``latest``.
            step: The step the directory is named by.
            layout: The plan's layout of the groups (``plan_layout``).
            shards: This rank's fp32 shards (the optimizer's ``shards()``).
            state: JSON state: rank 0's is written, except each rank's ``save.RANK_KEYS``.
            meta: ``{"config": ..., "topology": ...}`` for the manifest (rank 0's).
            buffers: ``{fqn: fp32 array}`` of the checkpointed buffers (rank 0's are written;
                ``checkpoint.model_buffers.buffer_values``).
            background: Write on a background thread (default ``options.background``).

        Returns:
            The step directory (committed when this returns, unless in the background).

        Raises:
            CheckpointError: (one line, on every rank) when any rank failed to write.
            ValueError: the state is not strict JSON (raised before anything is written).
        """
        shards = list(shards)
        if background is None:
            background = self.options.background
        if any(s.files is not None for s in shards):
            background = False  # the next step rewrites the swap files that the save copies
        job = saving.make_job(root, step, layout, shards, state, meta, buffers or {},
                               copy=background)
        self.owned.add((Path(root) / store.step_dir_name(step)).resolve())
        job = dataclasses.replace(job, owned=frozenset(self.owned))
        self.wait()
        if not background:
            return saving.write(self.group, job, self.options, self.refused)
        self._thread = threading.Thread(target=self._run, args=(job,), daemon=True,
                                        name="moezero-checkpoint")
        self._thread.start()
        return Path(job.root) / store.step_dir_name(job.step)

    def _run(self, job: saving.SaveJob) -> None:
        try:
            self._result = saving.write(self.group, job, self.options, self.refused)
        except BaseException as exc:  # re-raised on the training thread by wait()
            self._error = exc

    @property
    def failed(self) -> bool:
        """A background save has finished with an error (``wait`` raises it); never blocks."""
        thread = self._thread
        return thread is not None and not thread.is_alive() and self._error is not None

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

    def load(self, path: str | os.PathLike, targets: Iterable[StateShard],
             shapes: dict[str, tuple[int, ...]], buffers: dict | None = None, *,
             exact: bool = True, only: bool = False) -> dict:
        """Fill ``targets`` from a step directory or a root's newest complete checkpoint
        (collective); any world size, ``ep``, ZeRO stage or group cap may have saved it.

        ``buffers``: ``{fqn: tensor}`` of the checkpointed buffers to fill
        (``checkpoint.model_buffers.buffer_targets``). Returns this rank's saved state
        (``load.read_checkpoint``; {} when weights only). ``exact=False``: the checkpoint may
        hold more params than ``shapes`` (a base checkpoint read for the frozen ones).
        ``only``: the masters of the params in ``shapes`` alone (``load.read_checkpoint``).
        A read that fails after the checks (a damaged file) leaves the targets partly
        filled: load again or start afresh.

        Raises:
            CheckpointError: (one line, on every rank) when any rank failed.
        """
        self.wait()
        error, state = None, {}
        try:
            state = read_checkpoint(path, targets, shapes, self.rank, buffers or {},
                                    verify=self.options.verify_on_load,
                                    chunk=self.options.io.chunk_bytes, exact=exact,
                                    only=only)
        except (CheckpointError, OSError, ValueError) as exc:
            error = f"rank {self.rank}: {one_line(exc)}"
        self.group.agree(error, f"checkpoint load from {path}")
        return state


def model_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """``{fqn: shape}`` of the global model (experts of every EP rank), as the plan sees it."""
    specs, _ = param_specs(model, lambda fqn, p: UserGroup("all"))
    return {s.fqn: s.shape for s in specs}
