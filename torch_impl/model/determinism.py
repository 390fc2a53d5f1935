"""The ``train.deterministic`` switch: deterministic CUDA kernels for the whole process.

moezero's own MoE dispatch is deterministic either way: rows move by gathers whose backward
is again a gather, the combine sums each token's k outputs in a fixed order, and no
``index_add_``/atomic scatter touches floating-point data (``moezero.model.dispatch``).
What the switch adds, on CUDA only, is torch's deterministic mode for everything else the
step runs: ``torch.use_deterministic_algorithms(True)`` (SDPA backward takes its
deterministic variants and excludes cuDNN attention; ``scatter_add_``/``index_add_`` and
friends take their sorted kernels; an op with no deterministic kernel raises), cuDNN without
benchmarking, and cuBLAS with a fixed workspace (``CUBLAS_WORKSPACE_CONFIG``, which cuBLAS
reads when a handle is created: configure before the first GEMM on the device, as the engine
does, or export it). On CPU the kernels moezero uses are already deterministic and nothing is
changed (deterministic mode would also NaN-fill every new tensor). Guarantees and costs:
docs/model.md ("Determinism").
"""

from __future__ import annotations

import os

import torch

CUBLAS_WORKSPACE = ":4096:8"


def configure(enabled: bool, device: torch.device) -> None:
    """Select deterministic kernels when ``enabled`` and ``device`` is CUDA; otherwise leave
    torch's settings as they are (a caller may have chosen them)."""
    if not enabled or device.type != "cuda":
        return
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
