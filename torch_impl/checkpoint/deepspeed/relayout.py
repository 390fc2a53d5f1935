"""What a DeepSpeed run of a Hugging Face model holds in another order or place than moezero:
gpt-oss's fused experts (``relaid``: an element permutation, not a contiguous range) and the
routers' ``e_score_correction_bias`` buffers of DeepSeek-V3 and GLM-4.5 (``buffer_values``:
in the module states, in no optimizer group).

gpt-oss's transformers model keeps per layer ``mlp.experts.gate_up_proj`` [E, D, 2F] (x @ W,
gate and up interleaved along the last dim), ``gate_up_proj_bias`` [E, 2F] (interleaved the
same way) and ``down_proj`` [E, F, D]; moezero's experts are [out, in] per expert. The import
copies each expert's block as it lies (contiguous in DeepSpeed's flat partitions) into the
places of the moezero tensors it feeds, split in equal halves (``source``), then, once every
rank's pieces are in, rewrites each block's tensors in moezero's order (``apply``), one block
of one state at a time. Only the tensors copied that way are rewritten (``relaid`` is given
them): per-expert params, or those a ``--names`` pattern maps, are [out, in] already. Adam's update is elementwise, so the master and both moments are
permuted alike. Counterpart of ``checkpoint/hf/gpt_oss.py`` (``source``), which reads the same
layouts from safetensors.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moezero.checkpoint.deepspeed import pickles
from moezero.checkpoint.hf.arch import Arch
from moezero.checkpoint.hf.family import Family
from moezero.checkpoint.hf.gpt_oss import MOE, fused_weight, split_gate_up
from moezero.checkpoint.hf.names import hf_name
from moezero.plan import store
from moezero.plan.layout import ITEMSIZE, RangeRecord
from moezero.plan.store import CheckpointError


@dataclass(frozen=True)
class Block:
    """One DeepSpeed block copied raw into ``fqns`` (their element counts, in order, tile it):
    ``split(block reshaped to shape)`` gives each FQN's tensor in moezero's order."""

    fqns: tuple[str, ...]
    shape: tuple[int, ...]
    split: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]


def source(fqn: str, arch: Arch, family: Family
           ) -> tuple[str, int, int, tuple[int, ...]] | None:
    """(DeepSpeed param, element range, the param's shape) whose raw elements go to ``fqn``'s
    place, for the tensors of gpt-oss's MoE blocks; None for every other tensor (the names
    table's)."""
    m = MOE.fullmatch(fqn) if family.interleaved_gate_up else None
    if m is None:
        return None
    layer, e, w, kind = m.groups()
    p, n, d, f = f"model.layers.{layer}.mlp.", arch.num_experts, arch.dim, arch.ffn_dim
    if e is None:
        return p + f"router.{kind}", 0, n * (d if kind == "weight" else 1), \
            (n, d) if kind == "weight" else (n,)
    e, bias = int(e), kind == "bias"
    if w == "w2":
        size = d if bias else f * d
        return p + "experts.down_proj" + ("_bias" if bias else ""), e * size, (e + 1) * size, \
            (n, d) if bias else (n, f, d)
    half = f if bias else f * d  # gate_up_proj[e] (or its bias): w1's half, then w3's
    start = 2 * e * half + (half if w == "w3" else 0)
    return p + "experts.gate_up_proj" + ("_bias" if bias else ""), start, start + half, \
        (n, 2 * f) if bias else (n, d, 2 * f)


def relaid(raw, arch: Arch, family: Family) -> list[Block]:
    """The blocks to rewrite in moezero's order: those of ``raw``, the FQNs whose elements were
    copied as DeepSpeed holds them (``source``); w1 and w3 of one expert come in pairs."""
    if not family.interleaved_gate_up:
        return []
    d, f, out = arch.dim, arch.ffn_dim, []
    for fqn in sorted(raw):
        m = MOE.fullmatch(fqn)
        if m is None or m[2] is None or (m[3], m[4]) == ("w2", "bias"):
            continue
        if m[3] == "w2":  # down_proj[e]: [F, D] -> [D, F]
            out.append(Block((fqn,), (f, d), lambda t: (fused_weight(t, "w2"),)))
            continue
        pair = tuple(f"layers.{m[1]}.moe.experts.{m[2]}.{w}.{m[4]}" for w in ("w1", "w3"))
        if not set(pair) <= set(raw):
            other = pair[fqn == pair[0]]
            raise CheckpointError(f"{fqn} comes from the fused gate_up_proj, {other} from "
                                  "another param (--names): map both or neither")
        if m[3] == "w3":
            continue
        if m[4] == "weight":  # gate_up_proj[e]: [D, 2F] -> gate [F, D], up [F, D]
            out.append(Block(pair, (d, 2 * f),
                             lambda t: (fused_weight(t, "w1"), fused_weight(t, "w3"))))
        else:  # gate_up_proj_bias[e]: [2F] -> gate [F], up [F]
            out.append(Block(pair, (2 * f,), split_gate_up))
    return out


def apply(layout, partial: Path, blocks: list[Block], records: list[RangeRecord]
          ) -> list[RangeRecord]:
    """Rewrite every block of every state in moezero's order; ``records`` with those written
    by the raw copy inside the rewritten ranges replaced by one per rewritten range."""
    where = _places(layout)
    done: dict[str, list[tuple[int, int]]] = {}
    out = []
    for block in blocks:
        for state in sorted({s for fqn in block.fqns for s in where.get(fqn, {})}):
            places = [where[fqn][state] for fqn in block.fqns]
            raw = torch.cat([_read(partial, p) for p in places]).reshape(block.shape)
            for parts, value in zip(places, block.split(raw), strict=True):
                out += _write(partial, parts, value.contiguous().reshape(-1))
                for name, at, _, n in parts:
                    done.setdefault(name, []).append((at, at + n * ITEMSIZE))
    spans = {name: sorted(ranges) for name, ranges in done.items()}
    return [r for r in records if not _inside(r, spans)] + out


def _inside(record: RangeRecord, spans: dict[str, list[tuple[int, int]]]) -> bool:
    """Whether ``record`` starts inside a rewritten byte range (``spans``: sorted, per file)."""
    ranges = spans.get(record.file, [])
    i = bisect.bisect_right(ranges, (record.offset, float("inf"))) - 1
    return i >= 0 and ranges[i][0] <= record.offset < ranges[i][1]


def _places(layout) -> dict[str, dict[str, list[tuple[str, int, int, int]]]]:
    """{fqn: {state: [(file, byte offset, first element, elements)] in element order}}."""
    out: dict = {}
    for f in layout.model_files + layout.optim_files:
        for t in f.tensors:
            out.setdefault(t.fqn, {}).setdefault(t.state, []).append(
                (f.name, f.data_start + t.begin, t.start, t.stop - t.start))
    for states in out.values():
        for parts in states.values():
            parts.sort(key=lambda p: p[2])
    return out


def _read(partial: Path, parts) -> torch.Tensor:
    """The elements of ``parts`` (in order) as written by the raw copy."""
    chunks = []
    for name, at, _, n in parts:
        fd = os.open(partial / name, os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = os.pread(fd, n * ITEMSIZE, at)
        finally:
            os.close(fd)
        if len(data) != n * ITEMSIZE:
            raise CheckpointError(f"{partial / name}: {len(data)} bytes at {at}, expected "
                                  f"{n * ITEMSIZE} (truncated while importing)")
        chunks.append(torch.from_numpy(np.frombuffer(data, np.float32).copy()))
    return torch.cat(chunks)


def _write(partial: Path, parts, flat: torch.Tensor) -> list[RangeRecord]:
    """``flat`` (one tensor's elements) to its ``parts``, each at its first element."""
    records = []
    for name, at, start, n in parts:
        data = flat[start:start + n].numpy()
        crc = store.write_range(partial / name, at, data)
        records.append(RangeRecord(name, at, n * ITEMSIZE, crc))
    return records


def buffer_values(layout, model_file: Path, family: Family) -> dict[str, np.ndarray]:
    """{fqn: value} of the layout's buffers (the routers' ``e_score_correction_bias``), from
    the module DeepSpeed saved in ``model_file`` (buffers are whole there at every stage)."""
    if not layout.buffers:
        return {}
    module = pickles.load(model_file).get("module") or {}
    out = {}
    for fqn, shape in layout.buffers:
        key = hf_name(fqn, family)
        value = module.get(key)
        if value is None or tuple(value.shape) != tuple(shape):
            got = "absent" if value is None else f"of shape {list(value.shape)}"
            raise CheckpointError(f"{model_file}: buffer {key} {got}; moezero's {fqn} needs "
                                  f"{list(shape)}")
        out[fqn] = value.detach().float().numpy()
    return out
