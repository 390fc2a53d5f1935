"""How checkpoint tensors are encoded on disk: the dtype tags a layout may use and the
safetensors header of a file (``moezero.plan.layout`` builds every file's header with it; the
torch export writes its own files with it too).

Optimizer state and buffers are always fp32 (``F32``); the model files of a weights-only
layout may be ``BF16`` or ``F16`` (an import that keeps its source's dtype), which every reader
upcasts exactly (``moezero.plan.reading.upcast_into``).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Sequence
from typing import Any

ITEMSIZE = 4  # fp32 ("F32"): optimizer state, buffers, and the masters unless told otherwise
WEIGHT_DTYPES = {"F32": 4, "BF16": 2, "F16": 2}  # safetensors tag -> bytes per element
HEADER_ALIGN = 8


def check_dtype(dtype: str, weights_only: bool) -> None:
    """ValueError (one line) unless ``dtype`` is a known tag, and F32 for a layout with
    optimizer state."""
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(WEIGHT_DTYPES)}, got {dtype!r}")
    if dtype != "F32" and not weights_only:
        raise ValueError(f"a {dtype} layout must be weights only (optimizer state is F32)")


def safetensors_header(metadata: dict[str, str],
                       tensors: Iterable[tuple[str, str, Sequence[int], int, int]]) -> bytes:
    """The safetensors prefix of (key, dtype tag, shape, begin, end) entries, offsets from the
    data section: u64 LE length, compact JSON, spaces to a multiple of 8."""
    obj: dict[str, Any] = {"__metadata__": metadata}
    for key, dtype, shape, begin, end in tensors:
        obj[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}
    text = json.dumps(obj, separators=(",", ":")).encode("ascii")
    text += b" " * (-len(text) % HEADER_ALIGN)
    return struct.pack("<Q", len(text)) + text
