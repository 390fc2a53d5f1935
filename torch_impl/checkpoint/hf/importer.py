"""``moezero import-hf``: a local Hugging Face MoE directory -> a weights-only moezero
checkpoint (docs/hf.md, "Import").

The family comes from ``config.json``'s ``model_type``. Everything is checked (the config, and
every tensor's name and shape, from the safetensors headers) before anything is written; then
each tensor is read as a slice of its file, cast to the import's dtype (``--dtype``, by default
the family's ``import_dtype`` or else the source's: ``checkpoint.hf.dtypes``) and written to its place in the plan's layout
(``plan_layout(..., weights_only=True, dtype=...)``) under ``out/step_00000000/``, committed
atomically with ``out/latest``, plus ``out/config.yaml``. Streamed: whole rows of about 8 MiB
at a time, each a lazy slice of its file (``HFTensors.read_rows``), never a whole tensor.
Grouped-query K/V projections keep their shapes.
"""

from __future__ import annotations

import math
import os
import re
import zlib
from pathlib import Path

import torch
from pydantic import ValidationError

from moezero.checkpoint import tokenizer as hf_tokenizer
from moezero.checkpoint.hf import carried, dtypes, fp8
from moezero.checkpoint.hf.arch import Arch
from moezero.checkpoint.hf.families import family_of_config
from moezero.checkpoint.hf.family import Family
from moezero.checkpoint.hf.names import candidates, locate
from moezero.checkpoint.hf.reader import Derived, HFTensors
from moezero.checkpoint.model_buffers import buffer_shapes
from moezero.checkpoint.tools import refuse_non_empty
from moezero.config import Config, dump_config
from moezero.model.build import config_decoder
from moezero.model.specs import config_user_group, param_specs
from moezero.plan import plan_groups, plan_layout, store
from moezero.plan.bytes_io import CHUNK, byte_view
from moezero.plan.files import pwrite_all, read_json
from moezero.plan.layout import RangeRecord
from moezero.plan.model_buffer_io import write_buffers
from moezero.plan.store import CheckpointError

HF_CONFIG = "config.json"
_IGNORED = re.compile(r".*\.rotary_emb\.inv_freq")  # a buffer some old checkpoints saved


def read_hf_config(src: Path) -> tuple[Family, Arch, dict]:
    """The family, the checked architecture and the raw ``config.json`` of a directory."""
    if not src.is_dir():
        raise CheckpointError(f"{src}: no such directory")
    path = src / HF_CONFIG
    raw = read_json(path, f"{src}: no {HF_CONFIG} (not a Hugging Face model directory)")
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    family = family_of_config(raw, str(path))
    return family, family.read(raw, str(path)), raw


def import_config(arch: Arch, out: Path, where: str, tokenizer: dict | None = None) -> Config:
    """The default recipe with ``arch``, ``checkpoint.load: out`` and the ``tokenizer`` section
    (``out/config.yaml``)."""
    sections = arch.sections()
    ep = 2 if arch.num_experts % 2 == 0 else 1
    data = {**sections, "moe": {**sections["moe"], "ep_size": ep},
            "checkpoint": {"load": str(out.resolve())},
            "data": {"synthetic_vocab": min(32, arch.vocab_size)}, "tokenizer": tokenizer or {}}
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise CheckpointError(f"{where}: maps to {loc}: {err['msg']}") from None


def import_hf(src: str | Path, out: str | Path, dtype: str | None = None) -> Path:
    """Write the Hugging Face model in ``src`` as a weights-only moezero checkpoint in ``out``,
    its weights in ``dtype`` (``fp32``, ``bf16`` or ``fp16``; None: the source's dtype).

    Returns:
        The committed step directory ``out/step_00000000``.

    Raises:
        CheckpointError: (one line) a missing or unsupported input, or ``out`` not empty.
    """
    src, out = Path(src), Path(out)
    family, arch, raw = read_hf_config(src)
    refuse_non_empty(out)
    cfg = import_config(arch, out, str(src / HF_CONFIG), hf_tokenizer.describe_import(src, out))
    tensors = HFTensors(src, fp8.block_size(raw, str(src / HF_CONFIG)))
    dtype = dtypes.resolve(family.import_dtype if dtype is None else dtype,
                           set(tensors.files.values()))
    layout = _layout(cfg, dtype=dtypes.IMPORT_DTYPES[dtype][0])
    sources = {fqn: _source(tensors, fqn, shape, arch, family, src)
               for fqn, shape in layout.shapes + layout.buffers}
    dropped = family.dropped(raw) if family.dropped else None
    used = {key for s in sources.values() for key in (s.keys if isinstance(s, Derived) else s[:1])}
    used |= {fp8.scale_key(key) for key in used if tensors.scaled(key)}
    carry = carried.carried_keys(family, tensors.files)  # Qwen3.5-MoE's vision tower, MTP
    used |= set(carry)
    _check_all_used(tensors, used, arch, src, dropped[0] if dropped else None)
    hf_tokenizer.copy_import(src, out)  # every header read and checked: now write
    if carry:
        for key, value in carried.copy_import(tensors.files, carry, raw, out).items():
            setattr(cfg.hf, key, value)
    source = {"format": f"hf-{family.model_type}", "path": str(src.resolve()), "config": raw}
    final = _write(layout, tensors, sources, out, meta={
        "config": cfg.model_dump(by_alias=True, mode="json"),
        "topology": {"world_size": 1, "ep_sizes": [cfg.moe.ep_size], "zero_stage": None,
                     "dtype": str(raw.get("dtype") or raw.get("torch_dtype") or "?"),
                     "writer": "import-hf"},
        "state": {"source": {**source, "note": dropped[1]} if dropped else source}})
    dump_config(cfg, out / "config.yaml")
    return final


def _write(layout, tensors: HFTensors, sources: dict, out: Path, meta: dict) -> Path:
    """The plan's crash-safe save at W = 1: headers, one range per tensor, manifest, commit."""
    partial = store.begin_save(out, 0)
    records = store.write_headers(layout, partial)
    for f in layout.model_files:
        fd = os.open(partial / f.name, os.O_WRONLY | os.O_CLOEXEC)
        try:
            for t in f.tensors:
                shape = layout.shape(t.fqn)
                crc = _write_fragment(fd, (f.data_start + t.begin, f.dtype), tensors,
                                      sources[t.fqn], shape, (t.start, t.stop))
                records.append(RangeRecord(f.name, f.data_start + t.begin, t.end - t.begin,
                                           crc))
            os.fsync(fd)
        finally:
            os.close(fd)
    records += write_buffers(partial, layout, {  # a few [E] fp32 biases: read whole
        fqn: tensors.read_rows(*sources[fqn], slice(0, shape[0])).numpy()
        for fqn, shape in layout.buffers})
    store.write_manifest(partial, layout, checksums=records, **meta)
    return store.commit(partial)


def _write_fragment(fd: int, where: tuple[int, str], tensors: HFTensors, source: tuple,
                    shape: tuple[int, ...], span: tuple[int, int]) -> int:
    """Flat elements ``span`` of the source tensor at ``where`` (offset, safetensors dtype tag),
    whole rows of about ``CHUNK`` bytes at a time; the crc32 of the bytes written."""
    offset, tag = where
    dtype = next(d for t, d in dtypes.IMPORT_DTYPES.values() if t == tag)
    itemsize = dtype.itemsize
    row = math.prod(shape[1:])
    step = max(1, CHUNK // (4 * row)) * row  # rows of about CHUNK bytes of fp32 read
    crc, (start, stop) = 0, span
    whole = source.build(tensors).reshape(-1) if isinstance(source, Derived) else None
    for lo in range(start, stop, step):
        hi = min(stop, lo + step)
        first = lo // row
        block = whole[first * row:-(-hi // row) * row] if whole is not None else \
            tensors.read_rows(*source, slice(first, -(-hi // row))).reshape(-1)
        part = block[lo - first * row:hi - first * row].to(dtype).contiguous()
        data = byte_view(part.view(torch.uint8).numpy())
        pwrite_all(fd, data, offset + (lo - start) * itemsize)
        crc = zlib.crc32(data, crc)
    return crc


def _source(tensors: HFTensors, fqn: str, shape: tuple[int, ...], arch: Arch, family: Family,
            where: Path) -> tuple[str, tuple]:
    """The (HF key, index) holding ``fqn``, or the family's ``Derived`` source, its shape
    checked (headers only)."""
    found = family.source(fqn, shape, arch, tensors, where) if family.source else None
    if found is not None:
        if not isinstance(found, Derived):
            tensors.check_shape(*found, shape)
        return found
    key, index = locate(fqn, candidates(fqn, arch, family), tensors.files, where)
    tensors.check_shape(key, index, shape)
    return key, index


def _layout(cfg: Config, *, step: int = 0, weights_only: bool = True, dtype: str = "F32"):
    """The plan's layout of the default recipe's groups for the imported architecture (by
    default weights only, in ``dtype``), so a run with the default grouping reads each group
    contiguously; the model's buffers (the expert biases, fp32) in their own file."""
    model = config_decoder(cfg, where="meta", adapters=False)
    specs, _ = param_specs(model, config_user_group(cfg))
    groups = plan_groups(specs, max_group_size=cfg.moe.max_group_size,
                         split_by_expert=cfg.moe.split_groups_by_expert,
                         split_dense_by_layer=cfg.moe.split_dense_by_layer)
    return plan_layout(groups, {s.fqn: s.shape for s in specs}, step=step,
                       weights_only=weights_only, buffers=buffer_shapes(model), dtype=dtype)


def _check_all_used(tensors: HFTensors, used: set[str], arch: Arch, src: Path,
                    dropped: re.Pattern | None = None) -> None:
    """Refuse a tensor moezero would silently drop (a bias, an extra norm, ...); the family's
    ``dropped`` ones are dropped on purpose, with a note."""
    tied = {"lm_head.weight"} if arch.tie_embeddings else set()
    left = sorted(k for k in set(tensors.files) - used - tied if not _IGNORED.fullmatch(k)
                  and not (dropped and dropped.fullmatch(k)))
    if left:
        raise CheckpointError(f"{src}: tensor {left[0]} has no place in moezero's decoder "
                              f"({len(left)} such tensors); refusing to drop it")
