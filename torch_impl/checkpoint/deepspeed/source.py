"""What a DeepSpeed checkpoint folder holds, found before anything is written.

A tag folder (``global_stepN``) of a ZeRO stage 1/2 run holds ``mp_rank_00_model_states.pt``
(the module, ``param_shapes``, counters, ``ds_config``; with native MoE, the experts are in
``layer_{l}_expert_{e}_mp_rank_00_model_states.pt`` instead) and one
``zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` per data-parallel rank (rank r's slice of each
group's flat fp32 master and Adam moments); stage 3 writes one model-states file per rank
(``zero_pp_rank_{r}_mp_rank_00_model_states.pt``). Only rank 0's model-states file is read
here (small: at stage 3 its module holds empty tensors); the optimizer files are only listed
and checked to be there, one per rank, and opened later one at a time. Stage 0 (no ZeRO) keeps
whole params and torch's optimizer state by param index (``unsharded``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from moezero.checkpoint.deepspeed import pickles, unsharded
from moezero.plan.store import CheckpointError

_OPTIM = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_TAG = re.compile(r"global_step(\d+)")


@dataclass(frozen=True)
class Source:
    """One DeepSpeed tag folder, as read from its rank-0 model-states file.

    ``groups``: per optimizer group, the ``(name, shape)`` of its params in flattening order.
    """

    folder: Path
    stage: int
    world_size: int
    groups: tuple[tuple[tuple[str, tuple[int, ...]], ...], ...]
    optim_files: tuple[Path, ...]  # rank order
    model_files: tuple[Path, ...]
    global_steps: int
    global_samples: int | None
    lr_scheduler: dict | None
    ds_config: dict
    ds_version: str
    dtype: str
    expert_files: tuple[Path, ...] = ()  # native MoE: layer_*_expert_*_mp_rank_00_model_states.pt
    skipped_steps: int | None = None  # optimizer steps skipped (fp16 overflow)


def find_tag(ckpt_dir: Path, tag: str | None) -> Path:
    """The tag folder: ``--tag``, else the one ``latest`` names, else the only ``global_step*``;
    always a folder directly in ``ckpt_dir`` (a path is refused)."""
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"{ckpt_dir}: no such directory")
    given = tag is not None
    if tag is None and (ckpt_dir / "latest").is_file():
        tag = (ckpt_dir / "latest").read_text().strip()
    if tag is None:
        tags = sorted(p.name for p in ckpt_dir.iterdir() if p.is_dir() and _TAG.fullmatch(p.name))
        if len(tags) != 1:
            found = ", ".join(tags) or "none"
            raise CheckpointError(f"{ckpt_dir}: give --tag (no 'latest' file; global_step* "
                                  f"folders: {found})")
        tag = tags[0]
    if Path(tag).name != tag or tag in (".", ".."):  # a path would import another run's tag
        named = "--tag" if given else f"{ckpt_dir / 'latest'} names"
        raise CheckpointError(f"{named} {tag!r}: not a folder of {ckpt_dir} (a tag is a "
                              "folder name such as global_step3; give another run's folder "
                              "as the checkpoint path)")
    folder = ckpt_dir / tag
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such tag folder")
    return folder


def read_source(folder: Path) -> Source:
    """The layout of a tag folder, checked: one optimizer file per data-parallel rank, no
    model parallelism, a stage and world size the files agree on."""
    model_files = _model_files(folder)
    states = pickles.load(model_files[0])
    world = _int(states, "dp_world_size", model_files[0])
    if states.get("mp_world_size", 1) != 1:
        raise CheckpointError(f"{model_files[0]}: mp_world_size={states['mp_world_size']}: "
                              "tensor/pipeline-parallel checkpoints are not supported")
    stage = int(states.get("ds_config", {}).get("zero_optimization", {}).get("stage", 0))
    if stage not in (0, 1, 2, 3):
        raise CheckpointError(f"{model_files[0]}: ZeRO stage {stage}: not a DeepSpeed stage")
    if stage == 3 and len(model_files) != world:
        raise CheckpointError(f"{folder}: {len(model_files)} model-states files for a stage-3 "
                              f"run of dp_world_size={world}")
    module = states.get("module") or {}
    dtype = str(next(iter(module.values())).dtype).removeprefix("torch.") if module else "?"
    experts = tuple(sorted(folder.glob("layer_*_expert_*_mp_rank_00_model_states.pt")))
    if stage == 0:
        optim, groups = _unsharded(folder, states, model_files[0], dtype, experts)
    else:
        optim = _optim_files(folder, world)
        groups = tuple(tuple((str(n), tuple(int(d) for d in s)) for n, s in g.items())
                       for g in states["param_shapes"])
    return Source(folder, stage, world, groups, optim, model_files,
                  _int(states, "global_steps", model_files[0]), states.get("global_samples"),
                  states.get("lr_scheduler"), dict(states.get("ds_config") or {}),
                  str(states.get("ds_version", "?")), dtype, experts,
                  skipped if isinstance(skipped := states.get("skipped_steps"), int) else None)


def _unsharded(folder: Path, states: dict, model_file: Path, dtype: str, experts):
    """Stage 0 (``unsharded``): the optimizer files, and the groups' params in index order."""
    if dtype != "float32":
        raise CheckpointError(f"{model_file}: ZeRO stage 0 with a {dtype} module: only fp32 "
                              "runs (whose module weights are the masters) are imported")
    optim = unsharded.optim_files(folder, model_file)
    ep = len(optim) if optim[0] != model_file else 1
    return optim, unsharded.param_groups(states, experts, ep, model_file)


def _model_files(folder: Path) -> tuple[Path, ...]:
    plain = folder / "mp_rank_00_model_states.pt"
    if plain.is_file():
        return (plain,)
    z3 = sorted(folder.glob("zero_pp_rank_*_mp_rank_00_model_states.pt"),
                key=lambda p: int(p.name.split("_")[3]))
    if not z3:
        raise CheckpointError(f"{folder}: no mp_rank_00_model_states.pt (not a DeepSpeed "
                              "checkpoint tag folder)")
    return tuple(z3)


def _optim_files(folder: Path, world: int) -> tuple[Path, ...]:
    ranks = {}
    for p in folder.iterdir():
        m = _OPTIM.fullmatch(p.name)
        if m:
            if m[2] != "00":
                raise CheckpointError(f"{p}: model-parallel rank {m[2]} is not supported")
            ranks[int(m[1])] = p
    missing = [r for r in range(world) if r not in ranks]
    if missing:
        raise CheckpointError(f"{folder}: missing the optimizer file of rank {missing[0]} "
                              f"(dp_world_size={world}; found {len(ranks)})")
    extra = sorted(set(ranks) - set(range(world)))
    if extra:
        raise CheckpointError(f"{ranks[extra[0]]}: rank {extra[0]} beyond dp_world_size={world}"
                              " recorded in the model states (world-size mismatch)")
    return tuple(ranks[r] for r in range(world))


def _int(states: dict, key: str, path: Path) -> int:
    value = states.get(key)
    if not isinstance(value, int):
        raise CheckpointError(f"{path}: no integer {key!r} (not a DeepSpeed model-states file)")
    return value
