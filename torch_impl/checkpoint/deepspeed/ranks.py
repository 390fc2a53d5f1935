"""One rank's optimizer file: its fp32 master and Adam moments as one vector per state.

Stages 1/2 keep ``optimizer_state_dict.single_partition_of_fp32_groups[g]`` and the moments
in ``optimizer_state_dict.base_optimizer_state.state[g]``; stage 3 keeps
``optimizer_state_dict.fp32_flat_groups[g]`` and ``optimizer_state_dict.optimizer_state_dict
.state[g]``. CPU-offloaded runs write the same entries (the state lives on the host).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moezero.checkpoint.deepspeed import pickles
from moezero.plan.store import CheckpointError

STATES = ("master", "exp_avg", "exp_avg_sq")
_SWAP = re.compile(r"(?:(exp_avg|exp_avg_sq)-)?(\d+)_(\d+)\.tensor\.swp")


@dataclass
class RankState:
    """A rank's per-group fp32 tensors (memory-mapped: read when used) and its counters."""

    parts: dict[str, list[torch.Tensor]]
    group_numel: tuple[int, ...]
    steps: tuple[int, ...]  # Adam's step of each group
    param_groups: list[dict]
    loss_scaler: object
    zero_stage: int
    meta: dict = field(default_factory=dict)  # ds_version, ds_config, partition_count

    def slice(self, state: str, offset: int, length: int) -> torch.Tensor:
        """Elements ``[offset, offset + length)`` of ``state`` in the rank's vector (its groups'
        partitions back to back), a view of one group's tensor: a piece never spans groups,
        and no group is copied."""
        for part in self.parts[state]:
            n = part.numel()
            if offset < n:
                if offset + length > n:
                    raise ValueError(f"[{offset}, {offset + length}) spans two groups")
                return part.detach().reshape(-1)[offset:offset + length]
            offset -= n
        raise ValueError(f"offset {offset} beyond the rank's {state}")


def read_rank(path: Path, offloaded: Path | None = None,
              numel_of: Callable[[int, int], int] | None = None) -> RankState:
    """The state of one ``*_optim_states.pt`` file (memory-mapped), one-line errors. A ZeRO-3
    run with its optimizer state on NVMe saves empty tensors there and the state in
    ``offloaded`` (``offloaded_tensors/rankNN``): read from those files instead
    (``read_offloaded``; ``numel_of(a, b)``: this rank's elements of params a..b)."""
    obj = pickles.load(path)
    top = obj.get("optimizer_state_dict")
    if not isinstance(top, dict):
        raise CheckpointError(f"{path}: no optimizer_state_dict (not a DeepSpeed ZeRO file)")
    stage = int(top.get("zero_stage", 0))
    inner, flat = (("optimizer_state_dict", "fp32_flat_groups") if stage == 3 else
                   ("base_optimizer_state", "single_partition_of_fp32_groups"))
    base, masters = top.get(inner), top.get(flat)
    if not isinstance(base, dict) or not isinstance(masters, list | tuple):
        raise CheckpointError(f"{path}: no {inner}/{flat} (ZeRO stage {stage} file expected)")
    state = base.get("state", {})
    moments = {k: [] for k in STATES[1:]}
    steps = []
    for g, master in enumerate(masters):
        entry = state.get(g)
        if entry is None or any(k not in entry for k in STATES[1:]):
            raise CheckpointError(f"{path}: group {g} has no Adam moments (exp_avg, exp_avg_sq)"
                                  "; only Adam/AdamW checkpoints are imported")
        for k in STATES[1:]:
            _check(path, g, k, entry[k], master.numel())
            moments[k].append(entry[k])
        steps.append(int(entry.get("step", 0)))
    parts = {"master": list(masters), **moments}
    if stage == 3 and masters and all(m.numel() == 0 for m in masters):
        if offloaded is None or not offloaded.is_dir():
            raise CheckpointError(f"{path}: the optimizer state is empty (offloaded to NVMe) and "
                                  f"there is no {offloaded or 'offloaded_tensors'} folder")
        parts = read_offloaded(offloaded, numel_of)
    meta = {"ds_version": obj.get("ds_version"), "ds_config": obj.get("ds_config"),
            "partition_count": top.get("partition_count")}
    return RankState(parts, tuple(m.numel() for m in parts["master"]), tuple(steps),
                     list(base.get("param_groups", [])), top.get("loss_scaler"), stage, meta)


def _check(path: Path, g: int, key: str, t, numel: int) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != numel:
        raise CheckpointError(f"{path}: group {g} {key} is not an fp32 tensor of the master's "
                              f"{numel} elements")


def read_offloaded(folder: Path, numel_of: Callable[[int, int], int]) -> dict[str, list]:
    """NVMe-offloaded ZeRO-3 state: DeepSpeed copies each sub-group's raw fp32 swap files
    (``{first}_{last}.tensor.swp`` for the master, ``exp_avg-…``, ``exp_avg_sq-…``, named by
    the ids of the sub-group's first and last params, padded to the I/O alignment) into the
    checkpoint. Raw floats, no pickle: each is memory-mapped."""
    found = {}
    for p in folder.iterdir():
        m = _SWAP.fullmatch(p.name)
        if m:
            found[(m[1] or "master", int(m[2]), int(m[3]))] = p
    parts = {k: [] for k in STATES}
    for a, b in sorted({(a, b) for _, a, b in found}):
        numel = numel_of(a, b)
        for key in STATES:
            path = found.get((key, a, b))
            if path is None:
                raise CheckpointError(f"{folder}: no {key} swap file of params {a}..{b}")
            if path.stat().st_size < numel * 4:
                raise CheckpointError(f"{path}: {path.stat().st_size} bytes, params {a}..{b} "
                                      f"need {numel * 4} (truncated)")
            parts[key].append(torch.from_file(str(path), shared=False, size=numel,
                                              dtype=torch.float32))
    return parts
