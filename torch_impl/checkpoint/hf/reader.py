"""The tensors of a Hugging Face model directory: key -> file, headers checked, each tensor
read in row ranges, lazy slices of its file, on demand (safetensors only, never pickled ``.bin`` weights)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from moezero.checkpoint.hf import fp8
from moezero.plan.layout import INDEX_NAME
from moezero.plan.store import CheckpointError


class HFTensors:
    """``files``: every tensor key of the directory and the file that holds it. ``fp8_block``:
    the block of an FP8 block-scaled checkpoint (``fp8.block_size``), whose weights with a
    ``weight_scale_inv`` beside them are read dequantized."""

    def __init__(self, root: Path, fp8_block: tuple[int, int] | None = None):
        self.fp8_block = fp8_block
        index = root / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: unreadable index: {exc}") from None
            self.files = {k: root / v for k, v in weight_map.items()}
        elif (root / "model.safetensors").is_file():
            with open_safetensors(root / "model.safetensors") as f:
                self.files = dict.fromkeys(f.keys(), root / "model.safetensors")
        else:
            raise CheckpointError(f"{root}: no model.safetensors or {INDEX_NAME} (only "
                                  "safetensors weights are read, never pickled .bin files)")

    def _open(self, key: str):
        return open_safetensors(self.files[key])

    def check_shape(self, key: str, index: tuple, shape: tuple[int, ...]) -> None:
        """CheckpointError unless ``key[index]`` (leading dim of a slice dropped) is ``shape``;
        reads the header only."""
        with self._open(key) as f:
            try:
                full = list(f.get_slice(key).get_shape())
            except Exception as exc:  # safetensors raises its own error type
                raise CheckpointError(f"{self.files[key]}: no tensor {key}: {exc}") from None
        got = tuple(len(range(*s.indices(n))) for s, n in zip(index, full, strict=False))
        got = (got + tuple(full[len(index):]))[1:] if index else tuple(full)
        if got != shape:
            raise CheckpointError(f"{self.files[key]}: {key}{_slice_text(index)} has shape "
                                  f"{got}, config.json implies {shape}")
        if self.scaled(key):
            self._check_scale(key, index, tuple(full))

    def scaled(self, key: str) -> bool:
        """Whether ``key`` is an FP8 weight read dequantized (its scale is beside it)."""
        return self.fp8_block is not None and fp8.scale_key(key) in self.files

    def _check_scale(self, key: str, index: tuple, full: tuple[int, ...]) -> None:
        """An FP8 weight: 2-D (per expert, as the Hub has them) with a scale per block."""
        scale = fp8.scale_key(key)
        with self._open(scale) as f:
            got = tuple(f.get_slice(scale).get_shape())
        grid = tuple(-(-n // b) for n, b in zip(full, self.fp8_block, strict=False))
        if index or len(full) != 2 or got != grid:
            raise CheckpointError(f"{self.files[scale]}: {scale} has shape {got} for {key} "
                                  f"{full}: moezero reads 2-D FP8 weights with a "
                                  f"{list(self.fp8_block)} block scale grid {grid}")

    def shape(self, key: str) -> tuple[int, ...]:
        """The shape of ``key`` (header only)."""
        with self._open(key) as f:
            return tuple(f.get_slice(key).get_shape())

    def read(self, key: str, index: tuple = ()) -> torch.Tensor:
        """``key[index]`` in its own dtype (a lazy slice of the file)."""
        with self._open(key) as f:
            part = f.get_slice(key)
            return part[index] if index else part[:]

    def read_rows(self, key: str, index: tuple, rows: slice) -> torch.Tensor:
        """Rows ``rows`` (first dim) of ``key[index]`` (leading dim of a slice dropped) as
        fp32: a lazy slice of the file, read and unmapped before returning, so neither the
        whole tensor nor its mapped pages stay in memory."""
        if index:
            inner = index[1] if len(index) > 1 else slice(0, None)
            base = inner.start or 0
            index = (index[0], slice(base + rows.start, base + rows.stop), *index[2:])
        with self._open(key) as f:
            part = f.get_slice(key)
            data = part[index][0] if index else part[rows]
        if not self.scaled(key):
            return data.float()
        scale = fp8.scale_key(key)
        with self._open(scale) as f:
            scale_SN = f.get_slice(scale)[fp8.scale_rows(rows, self.fp8_block)]
        return fp8.dequantize_rows(data, scale_SN, rows.start, self.fp8_block)


@dataclass(frozen=True)
class Derived:
    """A moezero tensor computed from slices of hub tensors ``keys`` (one expert of a fused,
    interleaved or quantized tensor: ``checkpoint/hf/gpt_oss.py``); ``build(tensors)``
    returns it whole, in fp32."""

    keys: tuple[str, ...]
    build: Callable[[HFTensors], torch.Tensor]


def open_safetensors(path: Path):
    """``safe_open(path)``; a missing or damaged file (its header read and checked against the
    file's size) is a one-line CheckpointError naming it."""
    try:
        return safe_open(path, "pt")
    except (OSError, ValueError, SafetensorError) as exc:
        cause = " ".join(str(exc).split())
        raise CheckpointError(f"{path}: not a readable safetensors file ({cause})") from None


def _slice_text(index: tuple) -> str:
    return "[" + ", ".join(f"{s.start}:{s.stop}" for s in index) + "]" if index else ""
