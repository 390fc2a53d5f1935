"""Every rank file of a DeepSpeed tag folder from one save (issue 38 #2).

Rank files are compared by more than their partition sizes, which two saves of one run (or
two runs of one model) share: each rank's Adam steps against rank 0's, and each file's own
records of the run (``ds_version``, ``ds_config``, ``partition_count``) against the model
states and the world size. A file that disagrees is refused in one line naming it; a copy of
a rank file from another step, or from a bf16 run of the same model, no longer imports as
a plausible mix of two states.
"""

from __future__ import annotations

from pathlib import Path

from moezero.checkpoint.deepspeed.ranks import RankState
from moezero.plan.store import CheckpointError


def check_rank(state: RankState, first: RankState, src, rank: int,
               eps: tuple[int | None, ...]) -> None:
    """CheckpointError (one line naming the file) unless rank ``rank``'s file belongs to the
    save of rank 0's file and of the model states ``src`` (``source.Source``); ``eps``: each
    group's expert-parallel size (None: dense)."""
    path = src.optim_files[rank]
    if state.steps != first.steps:
        raise CheckpointError(f"{path}: Adam step {_steps(state)}, rank 0's file says "
                              f"{_steps(first)} (rank files of different saves)")
    _same_run(state.meta, src, path)
    _partitions(state.meta.get("partition_count"), src, eps, path)


def step_notes(first: RankState, src) -> list[str]:
    """A note when rank 0's Adam step is not the model states' ``global_steps`` less the
    skipped ones: the optimizer state was reset at a resume (``load_optimizer_states=False``)
    or every rank file comes from another save. Not refused: the first is a real run."""
    if src.skipped_steps is None or not first.steps or not first.steps[0]:
        return []
    applied = src.global_steps - src.skipped_steps
    if first.steps[0] == applied:
        return []
    return [f"Adam step {first.steps[0]}, but the model states say global_steps "
            f"{src.global_steps} ({src.skipped_steps} skipped): the optimizer state was reset "
            "at a resume, or the rank files belong to another save"]


def _steps(state: RankState) -> str:
    steps = sorted(set(state.steps))
    return str(steps[0]) if len(steps) == 1 else str(steps)


def _same_run(meta: dict, src, path: Path) -> None:
    version, config = meta.get("ds_version"), meta.get("ds_config")
    if version is not None and str(version) != src.ds_version:
        raise CheckpointError(f"{path}: ds_version {version}, the model states say "
                              f"{src.ds_version}: a file of another run")
    if isinstance(config, dict) and config != src.ds_config:
        key = next(k for k in sorted(set(config) | set(src.ds_config))
                   if config.get(k) != src.ds_config.get(k))
        raise CheckpointError(f"{path}: ds_config differs from the model states' (at "
                              f"{key!r}): a file of another run")


def _partitions(count, src, eps: tuple[int | None, ...], path: Path) -> None:
    """ZeRO 1/2 record one partition count per group (the world, or the expert-data-parallel
    size of an expert group), ZeRO 3 one for all."""
    if count is None:
        return
    if src.stage == 3:
        want = src.world_size
    else:
        want = [src.world_size // (ep or 1) for ep in eps]
        count = [int(c) for c in count]
    if count != want:
        raise CheckpointError(f"{path}: partition_count {count}, a world of {src.world_size} "
                              f"ranks gives {want}")
