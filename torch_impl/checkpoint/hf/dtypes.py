"""The dtype an import writes its weights in (``moezero import-hf --dtype``, docs/hf.md).

A weights-only import keeps the source's dtype by default: a frozen base never trained needs
its values and nothing more, so a bf16 hub model costs 2 B per parameter on disk, not the 4 B
of an fp32 master. A full fine-tune still starts from fp32 masters, the exact upcasts. The
source's dtype is read from the safetensors headers: the one float dtype every tensor shares,
else fp32 (a mix, e.g. fp32 norms or dequantization scales beside bf16 weights, is kept
exactly).
"""

from __future__ import annotations

from pathlib import Path

import torch

from moezero.checkpoint.hf.reader import open_safetensors
from moezero.plan.store import CheckpointError

# --dtype value -> (safetensors tag of the checkpoint, torch dtype written)
IMPORT_DTYPES = {"fp32": ("F32", torch.float32), "bf16": ("BF16", torch.bfloat16),
                 "fp16": ("F16", torch.float16)}
BY_TAG = {tag: name for name, (tag, _) in IMPORT_DTYPES.items()}  # "BF16" -> "bf16"
_FLOATS = {"F32", "F64", "BF16", "F16"}


def source_dtype(files: set[Path]) -> str:
    """The ``--dtype`` that keeps the source exactly: ``bf16`` or ``fp16`` when every float
    tensor of ``files`` has that dtype, else ``fp32``."""
    tags = {t for path in sorted(files) for t in _header_dtypes(path) if t in _FLOATS}
    return BY_TAG.get(next(iter(tags)), "fp32") if len(tags) == 1 else "fp32"


def resolve(dtype: str | None, files: set[Path]) -> str:
    """``dtype`` checked (one line naming the choices), or the source's when None."""
    if dtype is None:
        return source_dtype(files)
    if dtype not in IMPORT_DTYPES:
        raise CheckpointError(f"import-hf --dtype: {dtype!r} is not one of "
                              f"{', '.join(IMPORT_DTYPES)}")
    return dtype


def _header_dtypes(path: Path) -> set[str]:
    """The dtype tags of the tensors of one safetensors file (its header only; a damaged file
    is a one-line CheckpointError naming it)."""
    with open_safetensors(path) as f:
        return {f.get_slice(key).get_dtype() for key in f.keys()}
