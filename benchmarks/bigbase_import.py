"""``moezero import-hf`` of the ``bigbase`` series' HF folder that deletes each source shard
once the import has read the last tensor it needs from it, so the folder and its import never
both lie whole on this box's disk (2 × 31 GB for the 16 B base, about the box's free space).

The import writes the dense groups first (every attention, router, norm, embedding and head
tensor), then the expert groups layer by layer (``checkpoint.hf.importer``: the plan's group
order). So once it reads an expert tensor of layer ``L``, every shard holding only non-expert
tensors and expert tensors of layers below ``L`` is done with, and is deleted. A shard deleted
too early would fail the import loudly (the reader opens the file on each read), never silently.
The result is the same checkpoint the CLI writes (same function, same arguments).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from unittest import mock

from moezero.checkpoint.hf import importer
from moezero.checkpoint.hf.reader import HFTensors

EXPERT_KEY = re.compile(r".*\.layers\.(\d+)\.mlp\.experts\.")


def _last_layer(keys: list[str]) -> int:
    """The highest expert layer among a shard's keys (-1: none)."""
    found = [int(m.group(1)) for m in map(EXPERT_KEY.match, keys) if m]
    return max(found, default=-1)


class ConsumingTensors(HFTensors):
    """``HFTensors`` that deletes the shards the import no longer needs (module docstring)."""

    def __init__(self, root: Path, *args, **kwargs):
        super().__init__(root, *args, **kwargs)
        index = json.loads((Path(root) / "model.safetensors.index.json").read_text())
        by_file: dict[str, list[str]] = {}
        for key, name in index["weight_map"].items():
            by_file.setdefault(name, []).append(key)
        self.pending = {Path(root) / name: _last_layer(keys) for name, keys in by_file.items()}
        self.deleted: list[str] = []

    def read_rows(self, key, index, rows):
        found = EXPERT_KEY.match(key)
        if found:
            self._release_below(int(found.group(1)))
        return super().read_rows(key, index, rows)

    def _release_below(self, layer: int) -> None:
        for path, last in list(self.pending.items()):
            if last < layer:
                path.unlink()
                self.deleted.append(path.name)
                del self.pending[path]


def import_consuming(src: Path, out: Path, dtype: str | None = None) -> list[str]:
    """``import_hf(src, out, dtype)``, deleting ``src``'s shards as they are consumed; the
    names of the shards deleted (the rest are left for the caller)."""
    made: list[ConsumingTensors] = []

    def tensors(*args, **kwargs):
        made.append(ConsumingTensors(*args, **kwargs))
        return made[-1]

    with mock.patch.object(importer, "HFTensors", tensors):
        importer.import_hf(src, out, dtype)
    return made[0].deleted if made else []
