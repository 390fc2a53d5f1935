"""Checkpoint tools behind ``moezero checkpoint inspect|verify|export`` (docs/checkpoint.md).

They read a committed checkpoint with ``moezero.plan.store`` (JSON and safetensors only) and
need no process group. ``export`` writes consolidated model weights as Hugging Face
safetensors files plus ``model.safetensors.index.json``, cast to bf16 or fp32, fragments
joined into whole tensors keyed by FQN (global expert ids), no optimizer state;
``moezero checkpoint export --format hf`` writes a Hugging Face family's names and a
``config.json`` instead (``moezero.checkpoint.hf``, docs/hf.md). Every export reads through
``moezero.plan.checked.CheckedReader``, so a changed byte is refused as a load refuses it, and
writes into an absent or empty ``--out`` only, removing what it wrote when it fails
(``into_empty``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from moezero.plan import store
from moezero.plan.bytes_io import CHUNK, byte_view
from moezero.plan.checked import CheckedReader
from moezero.plan.encoding import WEIGHT_DTYPES, safetensors_header
from moezero.plan.files import pwrite_all
from moezero.plan.layout import FORMAT_VERSION

__all__ = ["describe", "export", "into_empty", "refuse_non_empty", "verify", "write_weights"]


def refuse_non_empty(out: Path) -> None:
    """One-line CheckpointError unless ``out`` is absent or an empty directory, naming what it
    holds (a ``.partial`` left by a killed import or export says so)."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    partial = next((n for n in held if n.endswith(".partial")), None)
    what = (f": it holds {partial}, left by a killed import or export; remove it" if partial
            else f": it holds {held[0]}" if held else "")
    raise store.CheckpointError(f"--out {out}: exists and is not an empty directory{what}")


def into_empty(out: Path, write: Callable[[], list[Path]]) -> list[Path]:
    """``write()``'s files in ``out``, which must be absent or an empty directory (one-line
    CheckpointError otherwise, as import refuses); if ``write`` fails, what it left in
    ``out`` is removed (and ``out`` if it made it), then the error is raised."""
    refuse_non_empty(out)
    made = not out.exists()
    try:
        return write()
    except BaseException:
        if made:
            shutil.rmtree(out, ignore_errors=True)
        elif out.is_dir():
            for p in out.iterdir():
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink()
        raise

def verify(ckpt: Path) -> list[str]:
    """``moezero checkpoint verify``: one line per problem (``store.verify``), empty if sound."""
    return store.verify(ckpt)


def describe(ckpt: Path) -> str:
    """``moezero checkpoint inspect``: step, saving topology, groups, tensors and bytes."""
    m = store.read_manifest(ckpt)
    layout, topo = m.layout, m.topology
    numel = sum(math.prod(shape) for _, shape in layout.shapes)
    files = [ckpt / f.name for f in layout.files]
    on_disk = sum(p.stat().st_size for p in ckpt.iterdir() if p.is_file())
    headers = sum(f.data_start for f in layout.files)
    item = WEIGHT_DTYPES[layout.dtype]  # a weights-only import may keep bf16/fp16
    per = item if layout.weights_only else 12  # master (+ exp_avg + exp_avg_sq)
    frozen = sum(g.numel for g in layout.groups if g.frozen)  # weights only
    kind = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}[layout.dtype]
    what = f"{kind} weights only (no optimizer state)" if layout.weights_only else "fp32 state"
    state = per * (numel - frozen) + item * frozen
    lines = [f"checkpoint {ckpt}  step {m.step}  format version {FORMAT_VERSION}",
             f"saved by: world size {topo.get('world_size', '?')}, ep {topo.get('ep_sizes', '?')}, "
             f"ZeRO stage {topo.get('zero_stage', '?')}, {topo.get('dtype', '?')} compute"
             if topo.get("writer") != "import-hf" else
             f"written by moezero import-hf from {topo.get('dtype', '?')} Hugging Face weights",
             f"{len(layout.groups)} groups, {len(layout.shapes)} parameters ({numel:,} elements), "
             f"{sum(len(f.tensors) for f in layout.files)} tensors in {len(files)} safetensors files",
             f"bytes on disk {on_disk:,}: {what} {state:,} ({per} B x {numel - frozen:,}"
             + (f" + {item} B x {frozen:,} frozen" if frozen else "")
             + f"), headers {headers:,}, JSON {on_disk - state - headers:,}",
             f"{'group':<44} {'members':>7} {'elements':>12} {'bytes':>14}"]
    if m.base:
        lines.insert(2, f"adapters only: the frozen weights are in the base checkpoint "
                        f"{m.base['path']} (manifest sha256 {m.base['sha256'][:16]})")
    for g in layout.groups:
        size = (item if g.frozen else per) * g.numel
        lines.append(f"{g.name:<44} {len(g.members):>7} {g.numel:>12,} {size:>14,}")
    return "\n".join(lines)


EXPORT_DTYPES = {"fp32": (torch.float32, "F32"), "bf16": (torch.bfloat16, "BF16")}
SHARD_BYTES = 4 << 30  # per exported file


def export(ckpt: Path, out: Path, dtype: str = "fp32") -> list[Path]:
    """Consolidated model weights (no optimizer state) as Hugging Face safetensors + index.

    Fragments are reassembled into whole tensors keyed by FQN (global expert ids), buffers
    (the expert biases) included, cast to ``dtype``; files ``model.safetensors`` (or ``model-0000i-of-0000N`` above 4 GiB) and
    ``model.safetensors.index.json`` in ``out``. Streamed: one 8 MiB chunk of fp32 (and its
    cast) is in memory at a time, never a whole tensor.
    (``moezero.checkpoint.hf.export_hf`` writes the same under a Hugging Face family's names.)
    """
    m = store.read_manifest(ckpt)
    items = [(fqn, fqn, shape) for fqn, shape in m.layout.shapes + m.layout.buffers]
    meta = {"format": "pt", "moezero.step": str(m.step), "moezero.dtype": dtype}
    return write_weights(ckpt, m, out, items, dtype, meta=meta)


def write_weights(ckpt: Path, m, out: Path, items: list[tuple[str, str, tuple]], dtype: str,
                  *, meta: dict, shard_bytes: int | None = None,
                  keep_fp32: frozenset[str] = frozenset()) -> list[Path]:
    """Write ``items`` (key on disk, FQN in the checkpoint, shape) as safetensors shards of at
    most ``shard_bytes`` (default 4 GiB; one file is ``model.safetensors``) plus the index;
    the FQNs in ``keep_fp32`` stay fp32 whatever ``dtype`` (the Hub's DeepSeek-V3 expert
    biases). An item's FQN may be a composer instead (``read -> parts``, written in order: a
    family's fused or transformed layout, ``Family.export_items``)."""
    kinds = {fqn: EXPORT_DTYPES["fp32" if fqn in keep_fp32 else dtype] for _, fqn, _ in items}
    nbytes = {fqn: math.prod(shape) * kinds[fqn][0].itemsize for _, fqn, shape in items}
    cap = SHARD_BYTES if shard_bytes is None else shard_bytes
    shards, current, used = [], [], 0
    for item in items:
        if current and used + nbytes[item[1]] > cap:
            shards.append(current)
            current, used = [], 0
        current.append(item)
        used += nbytes[item[1]]
    shards.append(current)
    out.mkdir(parents=True, exist_ok=True)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    reader = CheckedReader(ckpt, m)  # every byte checked against the manifest, as load does
    for name, tensors in zip(names, shards, strict=True):
        _write_safetensors(out / name, (ckpt, m, reader), tensors, kinds, meta)
    weight_map = {key: name for name, tensors in zip(names, shards, strict=True)
                  for key, _, _ in tensors}
    index = {"metadata": {"total_size": sum(nbytes.values()), **meta}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return [out / n for n in names] + [out / "model.safetensors.index.json"]


def _write_safetensors(path: Path, source: tuple, tensors, kinds: dict, meta: dict) -> None:
    """One safetensors file: the header computed up front (``plan.encoding.safetensors_header``),
    then each tensor read from ``source`` (checkpoint, manifest, reader), cast to its
    ``kinds[fqn]`` (torch dtype, safetensors tag) and written ``CHUNK`` bytes of fp32 at a
    time with pwrite at its offset, under ``<name>.partial`` renamed when complete."""
    entries, cursor = [], 0
    for key, fqn, shape in tensors:
        torch_dtype, tag = kinds[fqn]
        entries.append((key, tag, shape, cursor, cursor + math.prod(shape) * torch_dtype.itemsize))
        cursor = entries[-1][4]
    header = safetensors_header(meta, entries)
    partial = path.with_name(path.name + ".partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        pwrite_all(fd, memoryview(header), 0)
        host = np.empty(CHUNK // 4, np.float32)
        for (_, fqn, shape), entry in zip(tensors, entries, strict=True):
            _write_tensor(fd, len(header) + entry[3], (*source, fqn), math.prod(shape),
                          host, kinds[fqn][0])
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(partial, path)


def _write_tensor(fd: int, offset: int, source: tuple, numel: int, host: np.ndarray,
                  torch_dtype: torch.dtype) -> None:
    """Elements of ``source`` (checkpoint, manifest, reader, FQN) at ``offset`` in
    ``torch_dtype``, one ``host`` buffer of fp32 at a time."""
    ckpt, m, reader, fqn = source
    if callable(fqn):  # composed of whole FQNs, in order (a hub's fused layout: Family)
        def read(name: str) -> torch.Tensor:
            flat = store.read_param(ckpt, m, name, reader=reader)
            return torch.from_numpy(flat).reshape(m.layout.shape(name))
        for part in fqn(read):
            data = part.contiguous().to(torch_dtype).view(torch.uint8).numpy()
            pwrite_all(fd, byte_view(data), offset)
            offset += data.nbytes
        return
    for lo in range(0, numel, host.size):
        part = store.read_param(ckpt, m, fqn, lo, min(numel, lo + host.size),
                                out=host[:min(numel - lo, host.size)], reader=reader)
        data = torch.from_numpy(part).to(torch_dtype).view(torch.uint8).numpy()
        pwrite_all(fd, byte_view(data), offset)
        offset += data.nbytes
