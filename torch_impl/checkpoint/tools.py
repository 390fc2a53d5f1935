"""Checkpoint tools behind ``moezero checkpoint inspect|verify|export`` (docs/checkpoint.md).

They read a committed checkpoint with ``moezero.plan.store`` (JSON and safetensors only) and
need no process group. ``export`` writes consolidated model weights as Hugging Face
safetensors files plus ``model.safetensors.index.json``, cast to bf16 or fp32, fragments
joined into whole tensors keyed by FQN (global expert ids), no optimizer state;
``moezero checkpoint export --format hf`` writes a Hugging Face family's names and a
``config.json`` instead (``moezero.checkpoint.hf``, docs/hf.md).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from moezero.plan import store
from moezero.plan.layout import FORMAT_VERSION

__all__ = ["describe", "export", "verify", "write_weights"]

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
    per = 4 if layout.weights_only else 12  # master (+ exp_avg + exp_avg_sq)
    what = "fp32 weights only (no optimizer state)" if layout.weights_only else "fp32 state"
    lines = [f"checkpoint {ckpt}  step {m.step}  format version {FORMAT_VERSION}",
             f"saved by: world size {topo.get('world_size', '?')}, ep {topo.get('ep_sizes', '?')}, "
             f"ZeRO stage {topo.get('zero_stage', '?')}, {topo.get('dtype', '?')} compute"
             if topo.get("writer") != "import-hf" else
             f"written by moezero import-hf from {topo.get('dtype', '?')} Hugging Face weights",
             f"{len(layout.groups)} groups, {len(layout.shapes)} parameters ({numel:,} elements), "
             f"{sum(len(f.tensors) for f in layout.files)} tensors in {len(files)} safetensors files",
             f"bytes on disk {on_disk:,}: {what} {per * numel:,} ({per} B x {numel:,}), "
             f"headers {headers:,}, JSON {on_disk - per * numel - headers:,}",
             f"{'group':<44} {'members':>7} {'elements':>12} {'bytes':>14}"]
    for g in layout.groups:
        lines.append(f"{g.name:<44} {len(g.members):>7} {g.numel:>12,} {per * g.numel:>14,}")
    return "\n".join(lines)


EXPORT_DTYPES = {"fp32": (torch.float32, "F32"), "bf16": (torch.bfloat16, "BF16")}
SHARD_BYTES = 4 << 30  # per exported file


def export(ckpt: Path, out: Path, dtype: str = "fp32") -> list[Path]:
    """Consolidated model weights (no optimizer state) as Hugging Face safetensors + index.

    Fragments are reassembled into whole tensors keyed by FQN (global expert ids), buffers
    (the expert biases) included, cast to ``dtype``; files ``model.safetensors`` (or ``model-0000i-of-0000N`` above 4 GiB) and
    ``model.safetensors.index.json`` in ``out``. One tensor is in memory at a time.
    (``moezero.checkpoint.hf.export_hf`` writes the same under a Hugging Face family's names.)
    """
    m = store.read_manifest(ckpt)
    items = [(fqn, fqn, shape) for fqn, shape in m.layout.shapes + m.layout.buffers]
    meta = {"format": "pt", "moezero.step": str(m.step), "moezero.dtype": dtype}
    return write_weights(ckpt, m, out, items, dtype, meta=meta)


def write_weights(ckpt: Path, m, out: Path, items: list[tuple[str, str, tuple]], dtype: str,
                  *, meta: dict, shard_bytes: int | None = None) -> list[Path]:
    """Write ``items`` (key on disk, FQN in the checkpoint, shape) as safetensors shards of at
    most ``shard_bytes`` (default 4 GiB; one file is ``model.safetensors``) plus the index."""
    torch_dtype, tag = EXPORT_DTYPES[dtype]
    size = torch.tensor([], dtype=torch_dtype).element_size()
    cap = SHARD_BYTES if shard_bytes is None else shard_bytes
    shards, current, used = [], [], 0
    for item in items:
        nbytes = math.prod(item[2]) * size
        if current and used + nbytes > cap:
            shards.append(current)
            current, used = [], 0
        current.append(item)
        used += nbytes
    shards.append(current)
    out.mkdir(parents=True, exist_ok=True)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for name, tensors in zip(names, shards, strict=True):
        _write_safetensors(out / name, ckpt, m, tensors, torch_dtype, tag, meta)
    weight_map = {key: name for name, tensors in zip(names, shards, strict=True)
                  for key, _, _ in tensors}
    total = sum(math.prod(shape) for _, _, shape in items) * size
    index = {"metadata": {"total_size": total, **meta}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return [out / n for n in names] + [out / "model.safetensors.index.json"]


def _write_safetensors(path: Path, ckpt: Path, m, tensors, torch_dtype, tag: str,
                       meta: dict) -> None:
    size = torch.tensor([], dtype=torch_dtype).element_size()
    header, cursor = {"__metadata__": meta}, 0
    for key, _, shape in tensors:
        n = math.prod(shape) * size
        header[key] = {"dtype": tag, "shape": list(shape), "data_offsets": [cursor, cursor + n]}
        cursor += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for _, fqn, _ in tensors:
            value = torch.from_numpy(store.read_param(ckpt, m, fqn)).to(torch_dtype)
            f.write(value.reshape(-1).view(torch.uint8).numpy().tobytes())
