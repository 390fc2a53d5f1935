"""``moezero import-deepspeed``: a DeepSpeed ZeRO checkpoint of a Hugging Face MoE model ->
a moezero checkpoint with fp32 masters, Adam moments and counters (docs/migrate-deepspeed.md).

Everything is checked before anything is written: the tag folder (every rank's optimizer file
present, stage and world size agreeing), the model's ``config.json`` (found in the checkpoint
folder or the one above it, as the transformers Trainer writes it, or given with
``--model-config``), and every moezero FQN's
source: a contiguous element range of one DeepSpeed parameter (``hf.names.candidates``, the
same name mapping as ``import-hf``). Then the writes are streamed rank by rank: one DeepSpeed
optimizer file open at a time (memory-mapped), each of its pieces written straight to its
place in the plan's layout under ``out/step_N.partial/`` with the crc32 of exactly the bytes
written (the manifest's ranges tile every file), then the manifest and an atomic commit.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from moezero.checkpoint.deepspeed import (
    agreement,
    patterns,
    placement,
    ranks,
    relayout,
    settings,
    unsharded,
)
from moezero.checkpoint.deepspeed.source import Source, find_tag, read_source
from moezero.checkpoint.hf.importer import HF_CONFIG, _layout, import_config, read_hf_config
from moezero.checkpoint.hf.names import candidates
from moezero.checkpoint.tools import refuse_non_empty
from moezero.config import Config, dump_config
from moezero.plan import store
from moezero.plan.files import fsync_file
from moezero.plan.layout import ITEMSIZE, RangeRecord
from moezero.plan.model_buffer_io import write_buffers
from moezero.plan.store import CheckpointError


@dataclass
class Report:
    """What the import read and wrote (printed by the CLI)."""

    source: Source
    step_dir: Path
    bytes_in: int
    bytes_out: int
    found: list[str]
    notes: list[str] = field(default_factory=list)
    eps: list[int] = field(default_factory=lambda: [1])
    numel: int = 0  # parameters, every expert counted


@dataclass(frozen=True)
class Write:
    """``length`` elements of ``state`` at ``offset`` of rank ``rank``'s vector -> ``file`` at
    byte ``at``."""

    rank: int
    state: str
    offset: int
    length: int
    file: str
    at: int


def import_deepspeed(ckpt_dir: str | Path, out: str | Path, tag: str | None = None,
                     names: str | Path | None = None,
                     model_config: str | Path | None = None) -> Report:
    """Convert the DeepSpeed checkpoint ``ckpt_dir`` (tag ``tag``) into ``out``; ``names``: a
    YAML of name patterns for native-MoE modules (``patterns``); ``model_config``: the
    model's ``config.json`` (or its folder) where it is not beside the checkpoint.

    Raises:
        CheckpointError: one line naming the file or setting; nothing is left at ``out``.
    """
    ckpt_dir, out = Path(ckpt_dir), Path(out)
    src = read_source(find_tag(ckpt_dir, tag))
    family, arch, raw = read_hf_config(_config_dir(ckpt_dir, model_config and Path(model_config)))
    refuse_non_empty(out)
    first = _read_rank(src, 0)
    eps = _group_eps(first, src)
    where = placement.plan(src.stage, src.world_size, src.groups, eps)
    _check_ranks(src, where, first, eps)
    cfg, notes = _config(arch, raw, src, first, out)
    layout = _layout(cfg, step=src.global_steps, weights_only=False)
    mapped = patterns.by_fqn(where.shapes, patterns.load(names and Path(names)))
    writes, raw = _writes(layout, where, mapped, arch, family, src)
    extra = (relayout.relaid(raw, arch, family),
             relayout.buffer_values(layout, src.model_files[0], family))
    created = not out.exists()
    try:
        step_dir = _write(layout, src, writes, out, extra, meta={
            "config": cfg.model_dump(by_alias=True, mode="json"),
            "topology": {"world_size": 1, "ep_sizes": [cfg.moe.ep_size], "zero_stage": None,
                         "dtype": src.dtype, "writer": "import-deepspeed"},
            "state": {"engine": _engine(src, first),
                      "source": {"format": f"deepspeed-zero{src.stage}",
                                 "path": str(src.folder.resolve()),
                                 "ds_version": src.ds_version, "ds_config": src.ds_config}}})
        dump_config(cfg, out / "config.yaml")
    except BaseException:  # Ctrl-C included: nothing half-written is left
        _remove(out, created)
        raise
    bytes_in = sum(p.stat().st_size for p in src.folder.rglob("*") if p.is_file())
    bytes_out = sum(p.stat().st_size for p in step_dir.iterdir())
    return Report(src, step_dir, bytes_in, bytes_out, _found(first),
                  agreement.step_notes(first, src) + notes + _unknown(src),
                  eps=sorted({e for e in eps if e}) or [1],
                  numel=sum(_prod(shape) for shape in where.shapes.values()))


def _config_dir(ckpt_dir: Path, model_config: Path | None = None) -> Path:
    """The folder of the model's ``config.json``: ``model_config`` (the file or its folder),
    else the checkpoint folder or the one above it."""
    if model_config is not None:
        folder = model_config if model_config.is_dir() else model_config.parent
        if model_config.name != HF_CONFIG and not model_config.is_dir() or \
                not (folder / HF_CONFIG).is_file():
            raise CheckpointError(f"--model-config {model_config}: not a {HF_CONFIG} nor a "
                                  f"folder holding one")
        return folder
    for d in (ckpt_dir, ckpt_dir.parent):
        if (d / HF_CONFIG).is_file():
            return d
    raise CheckpointError(f"{ckpt_dir}: no {HF_CONFIG} here or one folder up (the Hugging Face "
                          "config of the trained model; the transformers Trainer saves it "
                          "beside global_stepN; else give it with --model-config)")


def _config(arch, raw: dict, src: Source, first: ranks.RankState, out: Path):
    """The moezero recipe: the architecture, DeepSpeed's optimizer/precision/batch settings."""
    where = str(src.model_files[0])
    names = [[n for n, _ in g] for g in src.groups]
    if len(first.param_groups) != len(names):
        raise CheckpointError(f"{src.optim_files[0]}: {len(first.param_groups)} optimizer "
                              f"groups, the model states list {len(names)}")
    opt, notes = settings.optimizer_section(src.ds_config, first.param_groups, names, where)
    data = import_config(arch, out, str(out)).model_dump(by_alias=True, mode="json")
    aux = raw.get("router_aux_loss_coef", 0.0) if raw.get("output_router_logits") else 0.0
    data["moe"].update(aux_loss_coef=float(aux), z_loss_coef=0.0)
    if arch.expert_bias:  # transformers never moves e_score_correction_bias: neither does the run
        data["moe"]["bias_update_rate"] = 0.0
    data["optimizer"].update(opt)
    data["zero_optimization"].update(settings.zero_section(src.ds_config, src.stage))
    data["moe"]["ep_size"] = max((e for e in _group_eps(first, src) if e), default=1)
    data["precision"].update(settings.precision_section(src.ds_config))
    data["train"].update(settings.train_section(src.ds_config))
    try:
        return Config.model_validate(data), notes + _padding(raw) + _fixed_bias(arch)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise CheckpointError(f"{where}: maps to {'.'.join(map(str, err['loc']))}: "
                              f"{err['msg']}") from None


def _padding(raw: dict) -> list[str]:
    """transformers builds the embedding with ``padding_idx=pad_token_id``: that row gets no
    gradient. moezero's embedding has no such row (measured on OLMoE, pad 1, the token in the
    batch: embed.weight 3.4e-2 relative off DeepSpeed's after one step)."""
    pad = raw.get("pad_token_id")
    if not isinstance(pad, int) or isinstance(pad, bool):
        return []
    return [f"embedding padding_idx {pad}: transformers gives row {pad} of embed_tokens no "
            f"gradient, moezero trains it (the same only while token {pad} is not in the "
            "inputs)"]


def _fixed_bias(arch) -> list[str]:
    """The routers' ``e_score_correction_bias``: imported as the expert bias, kept fixed."""
    return ["expert-bias updates: off (moe.bias_update_rate 0), as transformers keeps "
            "e_score_correction_bias fixed; set the rate to train it with moezero's "
            "aux-loss-free rule"] if arch.expert_bias else []


def _source_range(fqn: str, shape, shapes: dict, mapped: dict, arch, family, where: str
                  ) -> tuple[str, int, int, bool] | None:
    """(DeepSpeed param, element range, copied raw) holding ``fqn``: the name a pattern maps to
    it, else the first name the Hugging Face mapping offers that DeepSpeed has, its
    leading-index slices turned into one contiguous range. Copied raw: gpt-oss's fused
    experts, whose elements ``relayout`` rewrites in moezero's order after the copy."""
    raw = None if fqn in mapped else relayout.source(fqn, arch, family)
    if raw is not None and raw[0] in shapes:
        if tuple(shapes[raw[0]]) != raw[3]:
            raise CheckpointError(f"{where}: DeepSpeed param {raw[0]} {list(shapes[raw[0]])}: "
                                  f"config.json implies {list(raw[3])}")
        return (*raw[:3], True)
    options = [(mapped[fqn], ())] if fqn in mapped else candidates(fqn, arch, family)
    for key, index in options:
        if key in shapes:
            a, b = _flat_range(shapes[key], index)
            if b - a != _prod(shape):
                raise CheckpointError(f"{where}: DeepSpeed param {key} {list(shapes[key])}: "
                                      f"the part for {fqn} has {b - a} elements, moezero "
                                      f"needs {list(shape)}")
            return key, a, b, False
    return None


def _flat_range(shape: tuple[int, ...], index: tuple) -> tuple[int, int]:
    """The flat elements of ``tensor[index]`` (leading slices, all but the last of length 1)."""
    start, inner = 0, _prod(shape)
    for dim, sl in zip(shape, index, strict=False):
        inner //= dim
        lo, hi, _ = sl.indices(dim)
        start += lo * inner
        last = (hi - lo) * inner
    return (start, start + last) if index else (0, _prod(shape))


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


def _writes(layout, where: placement.Placement, mapped: dict, arch, family,
            src: Source) -> tuple[list[Write], set[str]]:
    """Every piece to copy, checked: every moezero FQN has a source, every DeepSpeed param
    is used (lm_head may be the tied embedding); and the FQNs copied raw (``relayout``)."""
    sources, shapes = {}, where.shapes
    for fqn, shape in layout.shapes:
        found = _source_range(fqn, shape, shapes, mapped, arch, family, str(src.model_files[0]))
        if found is None:
            raw = relayout.source(fqn, arch, family)
            options = " or ".join(dict.fromkeys([*(raw[:1] if raw else ()), *(
                k for k, _ in candidates(fqn, arch, family))]))
            raise CheckpointError(f"{src.model_files[0]}: no parameter for {fqn} (looked for "
                                  f"{options})")
        sources[fqn] = found
    left = sorted(set(shapes) - {k for k, _, _, _ in sources.values()})
    if left:
        raise CheckpointError(f"{src.model_files[0]}: param {left[0]} has no place in moezero's "
                              f"decoder ({len(left)} such params; map it with --names); "
                              "refusing to drop it")
    out = []
    for f in layout.model_files + layout.optim_files:  # buffers: relayout.buffer_values
        for t in f.tensors:
            key, a, _, _ = sources[t.fqn]
            for p in where.pieces(key, a + t.start, a + t.stop):
                out.append(Write(p.rank, t.state, p.offset, p.length, f.name,
                                 f.data_start + t.begin + p.start * ITEMSIZE))
    return out, {fqn for fqn, found in sources.items() if found[3]}


def _write(layout, src: Source, writes: list[Write], out: Path, extra: tuple,
           meta: dict) -> Path:
    """Headers, then rank by rank its pieces (one optimizer file open at a time), the blocks
    copied raw rewritten in moezero's order and the buffers (``extra``: ``relayout``),
    manifest, commit."""
    blocks, buffers = extra
    partial = store.begin_save(out, layout.step)
    records = store.write_headers(layout, partial)
    for rank in range(len(src.optim_files)):  # stage 0: one per expert-parallel rank
        records += _write_rank(_read_rank(src, rank), partial,
                               [w for w in writes if w.rank == rank])
    records = relayout.apply(layout, partial, blocks, records)
    records += write_buffers(partial, layout, buffers)
    for f in layout.files:
        fsync_file(partial / f.name)
    store.write_manifest(partial, layout, checksums=records, **meta)
    return store.commit(partial, flushed=True, layout=layout)


def _write_rank(state: ranks.RankState, partial: Path, writes: list[Write]) -> list:
    """One rank's pieces, each range's crc32 computed from the bytes written."""
    records = []
    for w in writes:
        data = state.slice(w.state, w.offset, w.length).numpy()
        crc = store.write_range(partial / w.file, w.at, data)
        records.append(RangeRecord(w.file, w.at, w.length * ITEMSIZE, crc))
    return records


def _check_ranks(src: Source, where: placement.Placement, first: ranks.RankState,
                 eps: tuple[int | None, ...]) -> None:
    """Every rank's file read (its pickle; tensor data stays on disk) and checked against the
    model states and rank 0's file (``agreement``: one save)."""
    for rank in range(len(src.optim_files)):
        state = _read_rank(src, rank)
        _check_rank(state, where, src, rank)
        agreement.check_rank(state, first, src, rank, eps)


def _read_rank(src: Source, rank: int) -> ranks.RankState:
    """Rank ``rank``'s state; NVMe-offloaded state from ``offloaded_tensors/rankNN``, whose
    sub-groups are named by param ids (the params in order)."""
    if src.stage == 0:  # whole params; file ``rank`` is expert-parallel rank ``rank``'s
        return unsharded.read_rank(src.optim_files[rank],
                                   unsharded.masters(src.model_files[0], src.expert_files),
                                   unsharded.rank_names(src.groups, rank))
    per = [-(-_prod(shape) // src.world_size) for group in src.groups for _, shape in group]
    return ranks.read_rank(src.optim_files[rank], src.folder / "offloaded_tensors" /
                           f"rank{rank:02d}", lambda a, b: sum(per[a:b + 1]))


def _group_eps(first: ranks.RankState, src: Source) -> tuple[int | None, ...]:
    """Per group: the expert-parallel size of a native-MoE group (``moe: True``, named
    ``ep_size_N`` by DeepSpeed), None for a dense one."""
    out = []
    for g in first.param_groups:
        name = str(g.get("name", ""))
        if not g.get("moe"):
            out.append(None)
        elif name.startswith("ep_size_") and name[8:].isdigit():
            out.append(int(name[8:]))
        else:
            raise CheckpointError(f"{src.optim_files[0]}: MoE param group {name!r}: expected "
                                  "DeepSpeed's 'ep_size_N' name")
    if src.stage == 3 and any(out):
        raise CheckpointError(f"{src.optim_files[0]}: native MoE groups at ZeRO stage 3")
    return tuple(out)


def _check_rank(state: ranks.RankState, where: placement.Placement, src: Source,
                rank: int) -> None:
    path = src.optim_files[rank]
    if (state.zero_stage == 3) != (src.stage == 3):  # stages 1 and 2 share one format
        raise CheckpointError(f"{path}: ZeRO stage {state.zero_stage}, the model states say "
                              f"{src.stage}")
    if src.stage == 3:
        ok = sum(state.group_numel) == where.group_numel[0]
    else:
        ok = state.group_numel == where.group_numel
    if not ok:
        raise CheckpointError(f"{path}: partition of {list(state.group_numel)} elements, a "
                              f"world of {src.world_size} ranks needs "
                              f"{list(where.group_numel)} (world-size mismatch)")


def _engine(src: Source, first: ranks.RankState) -> dict:
    steps = set(first.steps)
    if len(steps) != 1:
        raise CheckpointError(f"{src.optim_files[0]}: groups at different Adam steps "
                              f"{sorted(steps)}")
    lr = first.param_groups[0].get("lr") if first.param_groups else None
    record = {"step_count": steps.pop(), "global_steps": src.global_steps,
              "lr_step": first.steps[0], "lr": lr}
    scaler = loss_scaler(first.loss_scaler)
    return {**record, "loss_scaler": scaler} if scaler else record


def loss_scaler(ds) -> dict | None:
    """moezero's fp16 scaler state from DeepSpeed's dynamic one (scale, clean steps since the
    last overflow within the window, hysteresis left); None for a static scaler (fp32, bf16)."""
    fields = vars(ds) if ds is not None else {}
    if not fields.get("dynamic") or "cur_scale" not in fields:
        return None
    clean = int(fields.get("cur_iter", 0)) - int(fields.get("last_overflow_iter", -1)) - 1
    return {"scale": float(fields["cur_scale"]),
            "good_steps": clean % int(fields.get("scale_window", 1000)),
            "hysteresis_left": int(fields.get("cur_hysteresis", fields.get("delayed_shift", 1)))}


def _found(first: ranks.RankState) -> list[str]:
    scaler = loss_scaler(first.loss_scaler)
    return ["fp32 master", "exp_avg", "exp_avg_sq", f"Adam step {first.steps[0]}",
            f"dynamic loss scale {scaler['scale']:g}" if scaler else "static loss scale"]


def _unknown(src: Source) -> list[str]:
    """What DeepSpeed recorded that moezero cannot use (one line each)."""
    notes = []
    if src.global_samples is not None:
        notes.append(f"data position: DeepSpeed counted {src.global_samples} samples but not "
                     "which; moezero's data starts at its own position 0")
    if src.lr_scheduler and not src.ds_config.get("scheduler"):
        notes.append("lr scheduler: one DeepSpeed's config does not name (a client's, e.g. the "
                     "transformers Trainer's): optimizer.lr is the lr of its last step, "
                     "constant (set optimizer.scheduler or warmup_steps yourself)")
    return notes


def _remove(out: Path, created: bool) -> None:
    """Undo a failed or interrupted import: ``out`` was absent or empty, so all it holds is
    the import's (its step folder, committed or not, ``config.yaml``); ``out`` goes too if the
    import made it."""
    for p in sorted(out.iterdir()) if out.is_dir() else []:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    if created and out.is_dir() and not any(out.iterdir()):
        os.rmdir(out)
