"""A DeepSpeed run without ZeRO (stage 0): whole params, torch's optimizer state by index.

DeepSpeed saves no ``param_shapes`` then. The weights are the module's (fp32: they are the
masters): dense ones in ``mp_rank_00_model_states.pt`` (``module``), native-MoE experts in
``layer_{l}_expert_{e}_mp_rank_00_model_states.pt`` under their global index. The Adam moments
are torch's ``optimizer.state_dict()``, keyed by param index: the model-states file's
``optimizer`` (rank 0's), and with native MoE one ``expp_rank_{k}_mp_rank_00_optim_states.pt``
per expert-parallel rank k (its ``optimizer``: the dense params and rank k's experts).

The index order is the order of the params in the groups DeepSpeed's optimizer was given, as
its ``param_groups`` record them: one dense group holds the module's params in module order
(``split_params_into_different_moe_groups_for_optimizer`` keeps it), and an ``ep_size_N`` group
the experts, layer by layer, local expert by local expert, each expert's params in its own
order. Anything else (two dense groups, two expert-parallel sizes, a count or a shape that
does not match) cannot be placed and is refused in one line.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from moezero.checkpoint.deepspeed import pickles, placement
from moezero.checkpoint.deepspeed.ranks import STATES, RankState
from moezero.plan.store import CheckpointError

_EXPP = re.compile(r"expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_EXPERT_FILE = re.compile(r"layer_(\d+)_expert_(\d+)_mp_rank_00_model_states\.pt")


def optim_files(folder: Path, model_file: Path) -> tuple[Path, ...]:
    """The files holding torch's optimizer state: one per expert-parallel rank with native MoE,
    else the model-states file itself."""
    found = {}
    for p in folder.iterdir():
        m = _EXPP.fullmatch(p.name)
        if m:
            if m[2] != "00":
                raise CheckpointError(f"{p}: model-parallel rank {m[2]} is not supported")
            found[int(m[1])] = p
    missing = [k for k in range(len(found)) if k not in found]
    if missing:
        raise CheckpointError(f"{folder}: missing expp_rank_{missing[0]}_mp_rank_00_optim_states"
                              f".pt (found {len(found)} expert-parallel optimizer files)")
    return tuple(found[k] for k in range(len(found))) or (model_file,)


def param_groups(states: dict, expert_files, ep: int, path: Path):
    """Per optimizer group (in ``param_groups`` order), the ``(name, shape)`` of its params in
    index order, as expert-parallel rank 0 names them."""
    groups = (states.get("optimizer") or {}).get("param_groups")
    if not isinstance(groups, list) or not groups:
        raise CheckpointError(f"{path}: ZeRO stage 0 and no optimizer param_groups (saved "
                              "without the optimizer?)")
    module = states.get("module") or {}
    buffers = set(states.get("buffer_names") or ())
    dense = [(n, tuple(t.shape)) for n, t in module.items() if n not in buffers]
    kinds = [bool(g.get("moe")) for g in groups]
    if kinds.count(False) != 1 or kinds.count(True) > 1:
        raise CheckpointError(f"{path}: ZeRO stage 0 with {kinds.count(False)} dense and "
                              f"{kinds.count(True)} expert param groups: the order of the params "
                              "is only known for one dense group (module order) and at most one "
                              "ep_size_N group")
    out = []
    for g, moe in zip(groups, kinds, strict=True):
        names = _local_experts(expert_files, ep) if moe else dense
        if len(g.get("params", ())) != len(names):
            raise CheckpointError(f"{path}: optimizer group {g.get('name', '?')!r} has "
                                  f"{len(g.get('params', ()))} params, the "
                                  f"{'expert files' if moe else 'module'} {len(names)}: the "
                                  "order of the params cannot be established")
        out.append(tuple(names))
    return tuple(out)


def _local_experts(expert_files, ep: int) -> list[tuple[str, tuple[int, ...]]]:
    """Expert-parallel rank 0's expert params: layer by layer, its experts 0..n-1 (n = experts
    per layer / ep), each expert's params in file order."""
    by_layer: dict[int, dict[int, Path]] = {}
    for p in expert_files:
        m = _EXPERT_FILE.fullmatch(p.name)
        by_layer.setdefault(int(m[1]), {})[int(m[2])] = p
    out = []
    for layer in sorted(by_layer):
        local = len(by_layer[layer]) // ep
        for e in range(local):
            out += [(n, tuple(t.shape)) for n, t in pickles.load(by_layer[layer][e]).items()]
    return out


def read_rank(path: Path, masters: dict, names: list[list[str]]) -> RankState:
    """Expert-parallel rank k's state: ``masters`` (name -> whole fp32 weight), ``names``: per
    group, rank k's param names in index order; the moments from ``path``'s ``optimizer``."""
    sd = pickles.load(path).get("optimizer")
    if not isinstance(sd, dict) or not isinstance(sd.get("state"), dict):
        raise CheckpointError(f"{path}: no optimizer state dict (torch's, keyed by param index)")
    groups = sd.get("param_groups", [])
    if [len(g.get("params", ())) for g in groups] != [len(n) for n in names]:
        raise CheckpointError(f"{path}: optimizer groups of {[len(g.get('params', ())) for g in groups]}"
                              f" params, rank 0's of {[len(n) for n in names]}")
    parts = {k: [] for k in STATES}
    steps = []
    for g, group in enumerate(groups):
        for index, name in zip(group["params"], names[g], strict=True):
            master = masters[name]
            entry = sd["state"].get(index)
            if entry is None or any(k not in entry for k in STATES[1:]):
                raise CheckpointError(f"{path}: param {index} ({name}) has no Adam moments "
                                      "(exp_avg, exp_avg_sq); only Adam/AdamW is imported")
            for key, t in (("master", master), *((k, entry[k]) for k in STATES[1:])):
                if t.dtype != torch.float32 or t.shape != master.shape:
                    raise CheckpointError(f"{path}: param {index} {key} is {t.dtype} "
                                          f"{list(t.shape)}, {name} is float32 "
                                          f"{list(master.shape)}: the order of the params "
                                          "cannot be established")
                parts[key].append(t.detach().reshape(-1))
        steps.append(int(sd["state"][group["params"][0]].get("step", 0)) if group["params"]
                     else 0)
    numel = tuple(sum(masters[n].numel() for n in group) for group in names)
    return RankState(parts, numel, tuple(steps), groups, None, 0)


def rank_names(groups, ep_rank: int) -> list[list[str]]:
    """Rank 0's names of each group, expert indices made global for ``ep_rank`` (a dense group
    has none)."""
    return [[placement.global_expert_name(n, ep_rank, placement.num_local_experts(group))
             for n, _ in group] for group in groups]


def masters(model_file: Path, expert_files) -> dict:
    """Every weight by its global name (memory-mapped)."""
    out = dict(pickles.load(model_file).get("module") or {})
    for p in expert_files:
        out.update(pickles.load(p))
    return out
