"""A ``TrainState`` to and from the checkpoint layout of docs/checkpoint.md (JAX side).

``load_train_state(ckpt, cfg)`` reads any checkpoint of the layout (saved by the torch engine at
any world size, ``ep``, ZeRO stage, group cap or offload mode, or by ``save_train_state``): every
parameter's fp32 master, ``exp_avg`` and ``exp_avg_sq`` by FQN through
``moezero.plan.store.read_param`` (fragments joined), into the params tree and the optax AdamW
state of ``moezero.reference.optim.make_optimizer`` with the saved optimizer step count. Continuing
with ``moezero.reference.optim.train_step`` is then the same run as the one that saved it.

``save_train_state(root, cfg, state)`` writes the same layout from one process: the plan's groups
for the reference model (``moezero.reference.zero_layout.param_specs``: the groups torch builds), each
group written whole as the one DP rank of a ``dp_size = 1`` partition, then the manifest and an
atomic commit. The torch engine loads it like its own checkpoints.

The optax state (``optax.adamw`` with a schedule) is ``(ScaleByAdamState(count, mu, nu),
MaskedState(EmptyState()), ScaleByScheduleState(count))``: ``mu``/``nu`` are torch's
``exp_avg``/``exp_avg_sq`` and both counts are the optimizer steps taken (torch's
``state.engine.step_count``; Adam's bias correction and the lr schedule both read it).
Not modelled here: the fp16 loss scaler and RNG states (returned in the manifest as saved).

Torch counterpart: ``moezero.checkpoint`` (``save``, ``load``); both sides write the
manifest's ``topology`` and ``state.engine`` from ``moezero.plan.records``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from moezero.plan import (
    MASTER,
    STATES,
    Layout,
    Manifest,
    RangeRecord,
    partition_group,
    plan_groups,
    plan_layout,
    store,
)
from moezero.plan.model_buffer_io import check_buffers, write_buffers
from moezero.plan.records import EngineRecord, TopologyRecord
from moezero.plan.store import CheckpointError, find_checkpoint
from moezero.reference.optim import TrainConfig, TrainState, lr_at, make_optimizer
from moezero.reference.weights import buffer_shapes, from_fqn_dict, param_shapes, to_fqn_dict
from moezero.reference.zero_layout import ZeroConfig, param_specs

__all__ = ["CheckpointError", "find_checkpoint", "load_train_state", "read_fqn_state",
           "save_train_state", "step_count"]


def read_fqn_state(ckpt_dir: str | os.PathLike, manifest: Manifest,
                   state: str = MASTER) -> dict[str, np.ndarray]:
    """``{fqn: fp32 array of its full shape}`` of one state (``master``, ``exp_avg``,
    ``exp_avg_sq``), each parameter gathered by ``store.read_param`` from whatever files and
    fragments hold it. The moments of a weights-only checkpoint (``moezero import-hf``) are
    zeros: a fresh optimizer."""
    if state != MASTER and manifest.layout.weights_only:
        return {fqn: np.zeros(shape, np.float32) for fqn, shape in manifest.layout.shapes}
    return {fqn: store.read_param(ckpt_dir, manifest, fqn, state=state).reshape(shape)
            for fqn, shape in manifest.layout.shapes}


def _buffers(ckpt_dir, manifest: Manifest, cfg: TrainConfig, state: str) -> dict:
    """The buffers (expert biases) as saved, zero where not saved (an imported model); their
    Adam moments are zeros (the optimizer never touches them)."""
    saved = dict(manifest.layout.buffers)
    return {fqn: store.read_param(ckpt_dir, manifest, fqn).reshape(shape)
            if state == "master" and fqn in saved else np.zeros(shape, np.float32)
            for fqn, shape in buffer_shapes(cfg.model).items()}


def step_count(manifest: Manifest) -> int:
    """Optimizer steps taken at save: ``state.engine.step_count`` (the step directory's
    number counts fp16-skipped steps too), else the manifest's step; 0 for weights only."""
    if manifest.layout.weights_only:
        return 0
    counters = manifest.state.get("engine", {}) if isinstance(manifest.state, dict) else {}
    return int(counters.get("step_count", manifest.step))


def load_train_state(ckpt_dir: str | os.PathLike, cfg: TrainConfig) -> tuple[TrainState, Manifest]:
    """Read a checkpoint into a ``TrainState`` for ``moezero.reference.optim.train_step``.

    Args:
        ckpt_dir: A step directory, or a root (its newest complete checkpoint).
        cfg: The run's config; its model must have exactly the checkpoint's parameters.

    Returns:
        ``(TrainState(step, params, opt_state), manifest)``: fp32 masters, AdamW moments and
        counts (``step_count``) as saved; the manifest carries the caller's state
        (``manifest.state["client"]``, e.g. the data position), the config and topology.

    Raises:
        CheckpointError: (one line) an incomplete or inconsistent checkpoint, or one whose
            parameters or shapes differ from the model's.
    """
    where = find_checkpoint(ckpt_dir)
    manifest = store.read_manifest(where)
    store.check_shapes(manifest, param_shapes(cfg.model), where)
    check_buffers(manifest, buffer_shapes(cfg.model), where)
    params, mu, nu = (from_fqn_dict({**read_fqn_state(where, manifest, s),
                                     **_buffers(where, manifest, cfg, s)}, cfg.model)
                      for s in STATES)
    steps = step_count(manifest)
    count = jnp.asarray(steps, jnp.int32)
    opt_state = make_optimizer(cfg.optim).init(params)
    # ``count`` is both the Adam count (bias correction) and the schedule's count (lr).
    opt_state = optax.tree.set(opt_state, mu=mu, nu=nu, count=count)
    return TrainState(count, params, opt_state), manifest


def save_train_state(root: str | os.PathLike, cfg: TrainConfig, state: TrainState, *,
                     step: int | None = None, ep_size: int = 1,
                     max_group_size: int | None = None, split_by_expert: bool = True,
                     client: dict | None = None, keep_last: int | None = None) -> Path:
    """Write ``state`` under ``root/step_XXXXXXXX/`` in the checkpoint layout and commit it.

    Args:
        root: The checkpoint root (``latest`` is replaced atomically).
        cfg: The run's config (recorded in the manifest).
        state: Its ``params`` (fp32 masters) and ``opt_state`` (``make_optimizer``'s) are saved.
        step: The step directory's number; default ``state.step``.
        ep_size, max_group_size, split_by_expert: The plan of the groups (as torch's
            ``moe.ep_size``, ``moe.max_group_size``, ``moe.split_groups_by_expert``); any
            plan is readable by any other.
        client: The caller's JSON state (e.g. ``{"data": batches.state_dict()}``).
        keep_last: Apply retention after the commit (None: keep everything).

    Returns:
        The committed step directory.
    """
    steps = int(jax.device_get(state.step))
    step = steps if step is None else int(step)
    zcfg = ZeroConfig(model=cfg.model, optim=cfg.optim, world_size=ep_size, ep_size=ep_size,
                      max_group_size=max_group_size, split_by_expert=split_by_expert)
    specs = param_specs(zcfg)
    groups = plan_groups(specs, max_group_size=max_group_size, split_by_expert=split_by_expert)
    layout = plan_layout(groups, {s.fqn: s.shape for s in specs}, step=step,
                         buffers=buffer_shapes(cfg.model))
    partial = store.begin_save(root, step)
    records = store.write_headers(layout, partial) + _write_groups(partial, layout, state)
    engine = EngineRecord(steps, step, float(lr_at(cfg.optim, steps)))
    topology = TopologyRecord(cfg.world_size, (ep_size,), None, cfg.dtype, max_group_size,
                              split_by_expert, writer="reference")
    store.write_manifest(
        partial, layout, checksums=records,
        config={"reference": _jsonable(dataclasses.asdict(cfg))}, topology=topology.to_json(),
        state={"engine": engine.to_json(), "client": client or {}})
    final = store.commit(partial)
    if keep_last is not None:
        store.apply_retention(root, keep_last)
    return final


def _write_groups(partial: Path, layout: Layout, state: TrainState) -> list[RangeRecord]:
    """Write the buffers and every group whole, as the only DP rank of a ``dp_size = 1``
    partition, then flush the files; returns the ranges' checksum records."""
    flat = dict(zip(STATES, (to_fqn_dict(state.params),
                             to_fqn_dict(optax.tree.get(state.opt_state, "mu")),
                             to_fqn_dict(optax.tree.get(state.opt_state, "nu"))), strict=True))
    records = write_buffers(partial, layout, flat[MASTER])
    for group in layout.groups:
        part = partition_group(group, world_size=group.ep_size)
        shards = {s: np.concatenate([_flat32(values[m.fqn])[m.start:m.stop]
                                     for m in group.members])
                  for s, values in flat.items()}
        records += store.write_partition(partial, layout, part, 0, **shards, fsync=False)
    for f in layout.files:
        store.fsync_file(partial / f.name)
    return records


def _flat32(value) -> np.ndarray:
    arr = np.asarray(jax.device_get(value))
    if arr.dtype != np.float32:
        raise ValueError(f"checkpoint state must be float32, got {arr.dtype}")
    return arr.reshape(-1)


def _jsonable(obj):
    """Dataclass dicts to strict JSON (tuples to lists)."""
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj
