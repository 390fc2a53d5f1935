"""Model buffers on disk: the writer and the load-time check of ``buffers.safetensors``
(``moezero.plan.model_buffers``; the file itself is planned by
``plan_layout(..., buffers=...)`` and read with ``store.read_param`` like any tensor).

Torch counterpart: ``moezero.checkpoint.model_buffers``; the reference calls these from
``moezero.reference.checkpoint``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from moezero.plan.layout import Layout, RangeRecord
from moezero.plan.store import CheckpointError, write_range

__all__ = ["check_buffers", "write_buffers"]


def write_buffers(ckpt_dir: str | Path, layout: Layout,
                  values: Mapping[str, np.ndarray]) -> list[RangeRecord]:
    """Write every buffer of the layout (``moezero.plan.model_buffers``) whole into its file, from
    ``values`` ({fqn: array of its shape}, cast to fp32); one checksum record per buffer.
    One writer (rank 0) calls it: buffers are replicated, never sharded."""
    f, records = layout.buffer_file, []
    for t in f.tensors if f is not None else ():
        flat = np.ascontiguousarray(values[t.fqn], np.float32).reshape(-1)
        if flat.size != t.stop:
            raise ValueError(f"buffer {t.fqn!r}: {flat.size} elements, the layout has {t.stop}")
        crc = write_range(Path(ckpt_dir) / f.name, f.data_start + t.begin, flat)
        records.append(RangeRecord(f.name, f.data_start + t.begin, flat.nbytes, crc))
    return records


def check_buffers(manifest, shapes: dict[str, tuple[int, ...]], where: Path) -> None:
    """CheckpointError (one line) if the checkpoint has a buffer the model lacks or of another
    shape. A buffer the checkpoint lacks is fine (e.g. an imported model): the loader starts
    it at its initial value."""
    for fqn, shape in manifest.layout.buffers:
        if fqn not in shapes:
            raise CheckpointError(f"{where}: the checkpoint has buffer {fqn} that the model "
                                  "does not")
        if tuple(shapes[fqn]) != tuple(shape):
            raise CheckpointError(f"{where}: buffer {fqn} has shape {tuple(shape)} in the "
                                  f"checkpoint, {tuple(shapes[fqn])} in the model")
