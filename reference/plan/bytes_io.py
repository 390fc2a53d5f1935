"""Bytes as both sides move them: the chunk of one system call and a flat byte view of an
array (stdlib + numpy). Used by ``moezero.plan.store`` and, on the torch side, by the async
file-I/O engine (``moezero.offload.aio``) and the checkpoint writer, so the rule is written once.
"""

from __future__ import annotations

import numpy as np

CHUNK = 8 << 20
"""Bytes per pread/pwrite call: the unit the store loops over and the async engine spreads
over its workers (the default of ``moezero.offload.options.IOOptions.chunk_bytes``)."""


def byte_view(data: np.ndarray | bytes | bytearray | memoryview) -> memoryview:
    """A flat unsigned-byte view of ``data``, without a copy when it is contiguous (writable
    when ``data`` is: reads may fill it)."""
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return memoryview(data).cast("B")
