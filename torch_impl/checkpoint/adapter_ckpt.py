"""Adapter checkpoints: the trained params only, beside a base checkpoint holding the frozen
ones (LoRA, docs/checkpoint.md "Files and keys").

A LoRA run remembers the checkpoint its base weights came from (``record``: the step
directory's path and the sha256 of its ``manifest.json``, which lists the crc32 of every byte
range, so it names the content). Its saves plan the trained groups only (``AdapterPlan``) and
put the record in the manifest (``base``), so their size is that of the adapters and their
optimizer state. A load of such a checkpoint first checks the base (``check``: refused in one
line when it is gone or changed), reads the frozen params from it and the rest from the
adapter checkpoint. Reference counterpart: ``moezero.plan.manifest.Manifest.base``.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from moezero.plan.grouping import GroupPlan, frozen_params, trained_groups
from moezero.plan.layout import MANIFEST_NAME
from moezero.plan.reading import read_manifest
from moezero.plan.store import CheckpointError

ADAPTER_SUFFIXES = (".lora_A", ".lora_B")


def record(step_dir: str | os.PathLike) -> dict:
    """``{"path", "sha256"}`` of a committed step directory (its manifest's digest)."""
    path = Path(step_dir).resolve()
    return {"path": str(path), "sha256": _digest(path)}


def check(base: dict, where: Path, moved: Path | None = None) -> Path:
    """The base step directory of adapter checkpoint ``where``; CheckpointError (one line)
    when it is missing or its manifest changed since the save.

    ``moved`` (``checkpoint export --base``): where the base is now, a step directory or the
    checkpoint root holding the recorded step's name; it must be the same base (its manifest's
    sha256 is the recorded one, so every checksum it lists is too)."""
    if moved is not None:
        return _moved(base, where, moved)
    path = Path(base["path"])
    try:
        found = _digest(path)
    except OSError as exc:
        raise CheckpointError(f"{where}: its base checkpoint {path} cannot be read "
                              f"({exc.strerror or exc}); if it moved, give its new place "
                              "with --base PATH (checkpoint export)") from None
    if found != base["sha256"]:
        raise CheckpointError(f"{where}: its base checkpoint {path} changed since the save "
                              f"(manifest sha256 {found[:16]}, saved {base['sha256'][:16]})")
    return path


def check_same(read_in_place: Path | None, source: Path) -> None:
    """CheckpointError (one line) when the run reads its frozen params in place from another
    base than ``source``, the one this load takes them from."""
    if read_in_place is not None and Path(read_in_place).resolve() != Path(source).resolve():
        raise CheckpointError(f"{source}: the frozen params of this run are read in place from "
                              f"{read_in_place}, another base; load a checkpoint of that base")


def frozen_source(ckpt: Path) -> Path:
    """The step directory holding the frozen params of a LoRA run loading ``ckpt``: the base
    named by an adapter checkpoint (checked unchanged), else ``ckpt`` itself."""
    manifest = read_manifest(ckpt)
    return check(manifest.base, ckpt) if manifest.base else Path(ckpt)


def _moved(base: dict, where: Path, moved: Path) -> Path:
    """The step directory at ``moved`` checked to be the base ``base`` recorded."""
    path = moved if (moved / MANIFEST_NAME).is_file() else moved / Path(base["path"]).name
    try:
        found = _digest(path)
    except OSError as exc:
        raise CheckpointError(f"--base {moved}: no base checkpoint of {where} there "
                              f"({exc.strerror or exc}: {path / MANIFEST_NAME})") from None
    if found != base["sha256"]:
        raise CheckpointError(f"--base {moved}: not the base of {where} (manifest sha256 "
                              f"{found[:16]}, the LoRA run's base {base['sha256'][:16]}, "
                              f"saved at {base['path']})")
    return path.resolve()


def _digest(step_dir: Path) -> str:
    return hashlib.sha256((step_dir / MANIFEST_NAME).read_bytes()).hexdigest()


@dataclass(frozen=True)
class AdapterPlan:
    """The trained groups of a plan and the shapes of their params, and the frozen params'
    shapes: what an adapter checkpoint holds and what its base must."""

    groups: tuple[GroupPlan, ...]
    trained: dict[str, tuple[int, ...]]
    frozen: dict[str, tuple[int, ...]]

    @classmethod
    def of(cls, plan: tuple[GroupPlan, ...], shapes: dict) -> AdapterPlan:
        groups, frozen = trained_groups(plan), set(frozen_params(plan))
        return cls(groups, {f: s for f, s in shapes.items() if f not in frozen},
                   {f: s for f, s in shapes.items() if f in frozen})

    @property
    def unfrozen(self) -> dict[str, tuple[int, ...]]:
        """The trained params that are not adapters (base params ``train.freeze``'s "!"
        patterns train): a fresh LoRA run reads their values from its base."""
        return {f: s for f, s in self.trained.items() if not f.endswith(ADAPTER_SUFFIXES)}

    def lacks_adapters(self, saved: dict) -> bool:
        """True when a checkpoint with params ``saved`` (FQN -> shape) has none of the
        adapters (a base for a fresh LoRA run) but every other trained param."""
        adapters = {f for f in self.trained if f.endswith(ADAPTER_SUFFIXES)}
        return bool(adapters) and not adapters & saved.keys() \
            and (self.trained.keys() - adapters) <= saved.keys()
