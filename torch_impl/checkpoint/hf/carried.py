"""Tensors and config keys a Hugging Face import carries through untrained (Qwen3.5-MoE's
vision tower and multi-token-prediction weights: ``Family.carried``), so the export is the same
multimodal model (docs/hf.md, "Qwen3.5-MoE").

``import-hf`` copies the carried tensors' bytes unchanged into ``<out>/hf_carried/
carried.safetensors`` (one tensor at a time, never the whole file in memory) beside the
source's ``config.json``, and records them in the checkpoint's config (``hf.model_type``,
``hf.carried``, ``hf.carried_sha256``); training carries that section into every checkpoint it
writes. ``export --format hf`` of that family checks the file's hash, appends it as the last
weight shard (the index names its keys) and nests the architecture's keys into the source's
``config.json`` (``Family.nest_config``).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

from moezero.data.tokenizer import file_sha256
from moezero.plan.encoding import safetensors_header
from moezero.plan.store import CheckpointError

FOLDER, WEIGHTS, CONFIG = "hf_carried", "carried.safetensors", "config.json"
_INDEX = "model.safetensors.index.json"
_CHUNK = 8 << 20


def raw_header(path: Path) -> tuple[int, dict]:
    """(data start, {key: {dtype, shape, data_offsets}}) of a safetensors file."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return 8 + size, header


def carried_keys(family, files: dict[str, Path]) -> list[str]:
    """The source's keys ``family`` carries unchanged (none for most families)."""
    return sorted(k for k in files if family.carried and family.carried.fullmatch(k))


def copy_import(files: dict[str, Path], keys: list[str], raw: dict, out: Path) -> dict:
    """Copy ``keys`` (their bytes, dtype and shape unchanged) and the source's ``config.json``
    ``raw`` into ``out/hf_carried``; the ``hf`` config section that records them."""
    folder = out / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    sources = {k: (files[k], *raw_header(files[k])) for k in keys}
    entries, cursor = [], 0
    for key in keys:
        info = sources[key][2][key]
        size = info["data_offsets"][1] - info["data_offsets"][0]
        entries.append((key, info["dtype"], info["shape"], cursor, cursor + size))
        cursor += size
    with open(folder / WEIGHTS, "wb") as dst:
        dst.write(safetensors_header({"format": "pt"}, entries))
        for key, *_ in entries:
            path, start, header = sources[key]
            lo, hi = header[key]["data_offsets"]
            _copy_bytes(path, start + lo, hi - lo, dst)
        dst.flush()
        os.fsync(dst.fileno())
    (folder / CONFIG).write_text(json.dumps(raw, indent=2))
    return {"model_type": raw["model_type"], "carried": str(folder.resolve()),
            "carried_sha256": file_sha256(folder / WEIGHTS)}


def _copy_bytes(path: Path, offset: int, size: int, dst) -> None:
    with open(path, "rb") as src:
        src.seek(offset)
        while size:
            block = src.read(min(_CHUNK, size))
            if not block:
                raise CheckpointError(f"{path}: truncated safetensors file")
            dst.write(block)
            size -= len(block)


def hf_section(config: dict | None) -> dict:
    """The ``hf`` section a checkpoint's config records (empty when none)."""
    return (config or {}).get("hf") or {}


def checked(family, config: dict | None) -> Path | None:
    """The carried folder a checkpoint's config records for ``family``, checked; None for a
    family that carries nothing. One-line CheckpointError when it is missing or changed."""
    return None if family.carried is None else _checked_folder(family, hf_section(config))


def attach(family, folder: Path | None, hf_config: dict, out: Path, weights: list[Path]
           ) -> tuple[dict, list[Path]]:
    """(the exported ``config.json`` object, the weight files): unchanged without a carried
    ``folder``; else its tensors as the last shard of ``out`` (the others renamed
    ``model-i-of-N``, the index rewritten) and ``hf_config`` nested into the source's
    config (``Family.nest_config``)."""
    if folder is None:
        return hf_config, weights
    saved = json.loads((folder / CONFIG).read_text())
    shards = [p for p in weights if p.name.endswith(".safetensors")]
    names = [out / f"model-{i + 1:05d}-of-{len(shards) + 1:05d}.safetensors"
             for i in range(len(shards) + 1)]
    for old, new in zip(shards, names, strict=False):
        os.replace(old, new)
    shutil.copyfile(folder / WEIGHTS, names[-1])
    weight_map, total = {}, 0
    for path in names:
        _, header = raw_header(path)
        weight_map.update(dict.fromkeys(header, path.name))
        total += sum(t["data_offsets"][1] - t["data_offsets"][0] for t in header.values())
    (out / _INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                          "weight_map": weight_map}, indent=1))
    return family.nest_config(hf_config, saved), [*names, out / _INDEX]


def _checked_folder(family, section: dict) -> Path:
    where = section.get("carried")
    if not where or section.get("model_type") != family.model_type:
        raise CheckpointError(f"export as Hugging Face {family.model_type} needs the tensors "
                              "import-hf carried through (hf.carried: the vision tower); this "
                              "checkpoint records none: export the language model with "
                              "--format hf-qwen3_next")
    folder = Path(where)
    path = folder / WEIGHTS
    if not path.is_file() or not (folder / CONFIG).is_file() \
            or file_sha256(path) != section.get("carried_sha256"):
        raise CheckpointError(f"{path}: missing or changed since the checkpoint recorded it "
                              f"(hf.carried_sha256 {str(section.get('carried_sha256'))[:12]}…)")
    return folder
